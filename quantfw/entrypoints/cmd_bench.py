"""``quantfw bench MODEL_OR_CONFIG --methods fp16,awq,gptq``: each method end to end through the
engine on dummy weights (no checkpoint download), against fp16 and the bandwidth floor.

Under ``torchrun --nproc-per-node N -m quantfw.entrypoints.cli bench ...`` every rank runs the
engine and rank 0 prints and writes the results (JSON, Markdown, PNG chart with the ``bench``
extra) to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import tempfile
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quantfw.bench.measure import BenchSettings
    from quantfw.bench.methods import BenchMethod

DEFAULTS = {
    "methods": "fp16,awq,gptq",
    "prompt_len": 2048,
    "batch_sizes": "1,16",
    "decode_context": 128,
    "decode_tokens": 128,
    "prefill_repeats": 7,
    "dtype": "float16",
    "group_size": 128,
    "out_dir": os.path.join("benchmarks", "results"),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark quantization methods end to end on a model shape (dummy weights)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL_OR_CONFIG",
        help="a bundled config (qwen3-8b, gpt-oss-20b, tiny-llama), a folder with config.json, a config.json "
        "file or a hub repo id (only its config.json is read)",
    )
    p.add_argument(
        "--methods",
        default=DEFAULTS["methods"],
        help="comma-separated: fp16 (unquantized, in --dtype), awq, gptq (sym, v1), gptq-asym, "
        "gptq-v2, gptq-act, kbit2..kbit5, kbit2-head..kbit5-head (the LM head quantized too), "
        "mxfp4, mxfp4-flashinfer (experts through FlashInfer; needs it installed)",
    )
    p.add_argument("--prompt-len", type=int, default=DEFAULTS["prompt_len"])
    p.add_argument("--batch-sizes", default=DEFAULTS["batch_sizes"], help="decode batch sizes")
    p.add_argument(
        "--decode-context",
        type=int,
        default=DEFAULTS["decode_context"],
        help="prompt tokens of each decode sequence",
    )
    p.add_argument(
        "--decode-tokens", type=int, default=DEFAULTS["decode_tokens"], help="decode steps timed"
    )
    p.add_argument(
        "--prefill-repeats",
        type=int,
        default=DEFAULTS["prefill_repeats"],
        help="timed prefills; the median is reported (single prefills swing by up to 2x)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="engine context (default: 4096 or what the prompts need, capped at the model's)",
    )
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=None)
    p.add_argument("--dtype", default=DEFAULTS["dtype"], help="activation dtype of every method")
    p.add_argument(
        "--group-size",
        type=int,
        default=DEFAULTS["group_size"],
        help="quantization group size of awq/gptq",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode eagerly")
    p.add_argument("--out-dir", default=DEFAULTS["out_dir"], help="where results are written")
    p.add_argument("--no-save", action="store_true", help="print only, write no files")
    p.add_argument("--revision", default=None, help="hub revision of MODEL_OR_CONFIG")
    p.set_defaults(func=run)


def command_line(args: argparse.Namespace, world_size: int) -> str:
    """The command that reproduces this run, with every setting spelled out."""
    parts = ["quantfw", "bench", args.model, "--methods", args.methods]
    parts += ["--prompt-len", str(args.prompt_len), "--batch-sizes", args.batch_sizes]
    parts += ["--decode-context", str(args.decode_context)]
    parts += ["--decode-tokens", str(args.decode_tokens), "--dtype", args.dtype]
    if args.group_size != DEFAULTS["group_size"]:
        parts += ["--group-size", str(args.group_size)]
    if args.max_model_len is not None:
        parts += ["--max-model-len", str(args.max_model_len)]
    if args.tp is not None:
        parts += ["--tp", str(args.tp)]
    if args.no_cuda_graphs:
        parts.append("--no-cuda-graphs")
    if world_size > 1:
        launcher = ["torchrun", f"--nproc-per-node={world_size}", "-m", "quantfw.entrypoints.cli"]
        parts = launcher + parts[1:]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from quantfw import distributed as qdist
    from quantfw.bench.configs import read_hf_config
    from quantfw.bench.measure import BenchSettings
    from quantfw.bench.methods import parse_methods

    methods = parse_methods(args.methods, args.group_size)
    settings = BenchSettings(
        prompt_len=args.prompt_len,
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",") if b.strip()),
        decode_context=args.decode_context,
        decode_tokens=args.decode_tokens,
        prefill_repeats=args.prefill_repeats,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        cuda_graphs=False if args.no_cuda_graphs else None,
    )
    config, label = read_hf_config(args.model, revision=args.revision)
    qdist.init_distributed(args.tp)
    writer = qdist.global_rank_from_env() == 0
    report = _measure_all(methods, config, label, settings, writer)
    if writer:
        _publish({"command": command_line(args, qdist.world_size_from_env()), **report}, args)
    qdist.destroy_distributed()
    return 1 if any(m["status"] == "error" for m in report["methods"].values()) else 0


def _measure_all(
    methods: list[BenchMethod],
    config: dict[str, Any],
    label: str,
    settings: BenchSettings,
    writer: bool,
) -> dict[str, Any]:
    """Every method in turn (a failing one is recorded and the others go on); the report."""
    import torch

    import quantfw
    from quantfw import distributed as qdist
    from quantfw.bench.configs import write_config_folder
    from quantfw.bench.measure import (
        device_name,
        measure_copy_bandwidth,
        measure_method,
        source_revision,
    )
    from quantfw.bench.report import add_comparisons
    from quantfw.config import ModelConfig

    def say(text: str) -> None:
        if writer:
            print(text, flush=True)

    results: dict[str, dict[str, Any]] = {}
    device = qdist.default_device()
    with tempfile.TemporaryDirectory(prefix="quantfw-bench-") as tmp:
        shape = ModelConfig(write_config_folder(config, os.path.join(tmp, "shape")))
        max_model_len = settings.model_len(shape.derived_context_length())
        bandwidth = measure_copy_bandwidth(device) if qdist.is_tp_leader() else None
        for method in methods:
            reason = method.unavailable()
            if reason is not None:
                results[method.name] = {"status": "skipped", "reason": reason}
                say(f"{method.name}: skipped: {reason}")
                continue
            say(f"{method.name}: building {label} with dummy weights ...")
            checkpoint_config = method.checkpoint_config_for(config)
            folder = write_config_folder(config, os.path.join(tmp, method.name), checkpoint_config)
            try:
                measured = measure_method(folder, method, settings, bandwidth=bandwidth)
            except Exception as e:  # one method failing (OOM, a kernel) must not lose the others
                results[method.name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
                if writer:
                    traceback.print_exc()
                say(f"{method.name}: error: {type(e).__name__}: {e}")
                continue
            if measured is not None:
                results[method.name] = {
                    "status": "ok",
                    "quantization_config": checkpoint_config,
                    "quantization_args": method.quantization_args,
                    **measured,
                }
                say(f"{method.name}: measured (engine built in {measured['build_s']:.1f} s)")
    add_comparisons(results)
    return {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "tensor_parallel_size": qdist.get_tp_size(),
        "torch": torch.__version__,
        "quantfw": quantfw.__version__,
        "source": source_revision(),
        "model": label,
        "config": {k: config.get(k) for k in _SHAPE_KEYS if k in config},
        "settings": {
            **vars(settings),
            "batch_sizes": list(settings.batch_sizes),
            "max_model_len": max_model_len,
        },
        "copy_bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None,
        "methods": results,
    }


_SHAPE_KEYS = (
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def _publish(report: dict[str, Any], args: argparse.Namespace) -> None:
    from quantfw.bench.report import (
        format_markdown,
        format_report,
        result_stem,
        write_chart,
        write_json,
    )

    text = format_report(report)
    print("\n" + text, end="")
    if args.no_save:
        return
    if not any(m["status"] == "ok" for m in report["methods"].values()):
        print("no method was measured: nothing written")
        return
    stem = os.path.join(args.out_dir, result_stem(report))
    write_json(report, stem + ".json")
    why_not = write_chart(report, stem + ".png")
    chart = None if why_not else os.path.basename(stem) + ".png"
    with open(stem + ".md", "w") as f:
        f.write(format_markdown(report, text, chart))
    written = [stem + ext for ext in (".json", ".md", ".png") if ext != ".png" or chart]
    print("wrote " + ", ".join(written) + (f"; {why_not}" if why_not else ""))
    sys.stdout.flush()
