"""``quantfw tune-w4a16 MODEL``: tune the W4A16 kernel configs for a 4-bit AWQ/GPTQ model's
per-rank linear shapes on this GPU and store them as this GPU model's config table.

The shapes come from the model built on the meta device (no weights are read); each is timed
on random weights rotated past L2 (``quantfw/kernels/w4a16/triton/tuning.py``).  Calls then
pick the table up when ``QUANTFW_W4A16_CONFIG_DIR`` names the output folder."""

from __future__ import annotations

import argparse
import os

from quantfw.kernels.w4a16 import tables as w4a16_tables

DEFAULT_MS = "1,4,16,64,256,1024,4096"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune-w4a16",
        help="tune the W4A16 (4-bit AWQ/GPTQ) kernel configs for a model's shapes on this GPU",
    )
    p.add_argument("model", help="HF repo id or local folder of a 4-bit AWQ or GPTQ checkpoint")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (per-rank shapes)")
    p.add_argument("--ms", default=DEFAULT_MS, help=f"token counts to tune (default {DEFAULT_MS})")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument(
        "--out-dir",
        default=os.environ.get(w4a16_tables.ENV_DIR),
        help=f"folder for the table (default: ${w4a16_tables.ENV_DIR})",
    )
    p.add_argument("--revision", default=None)
    p.set_defaults(func=run)


def w4a16_shapes(model: str, tp: int, revision: str | None = None) -> list[tuple[int, int, int]]:
    """The distinct per-rank ``(N, K, G)`` of the linear layers that rank 0 of ``tp`` runs
    through the W4A16 kernels (4-bit AWQ and GPTQ)."""
    from quantfw.config import ModelConfig
    from quantfw.entrypoints.cmd_info import shard_plan
    from quantfw.layers.linear import LinearBase
    from quantfw.layers.quantization.awq import AWQLinearMethod
    from quantfw.layers.quantization.gptq import GPTQLinearMethod

    mc = ModelConfig(model, revision=revision)
    qc = mc.quant_config
    if qc is None or qc.get_name() not in ("awq", "gptq") or getattr(qc, "bits", None) != 4:
        what = f"{qc.get_name()} ({qc!r})" if qc else "not quantized"
        raise ValueError(f"{model}: W4A16 kernels serve 4-bit awq and gptq; this model is {what}")
    meta, _ = shard_plan(mc, tp)
    shapes = []
    for module in meta.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase) and isinstance(
            method, AWQLinearMethod | GPTQLinearMethod
        ):
            K, N = module.input_size_per_partition, module.output_size_per_partition
            shapes.append((N, K, qc.group_size if qc.group_size > 0 else K))
    if not shapes:
        raise ValueError(f"{model}: no linear layer uses the {qc.get_name()} method")
    return list(dict.fromkeys(shapes))


def run(args: argparse.Namespace) -> int:
    import torch

    if not args.out_dir:
        raise ValueError(f"tune-w4a16: pass --out-dir or set {w4a16_tables.ENV_DIR}")
    if not torch.cuda.is_available():
        raise ValueError("tune-w4a16: needs a CUDA GPU (the configs are timed on it)")
    ms = sorted({int(m) for m in args.ms.split(",")})
    shapes = w4a16_shapes(args.model, args.tp, args.revision)
    print(f"{len(shapes)} shapes (N, K, G) at tp={args.tp}: {shapes}; M in {ms}")
    from quantfw.kernels.w4a16.triton.tuning import tune_shapes

    table = tune_shapes(shapes, ms, getattr(torch, args.dtype))
    name = torch.cuda.get_device_name()
    path = os.path.join(args.out_dir, w4a16_tables.file_name(name))
    source = f"quantfw tune-w4a16 {args.model} --tp {args.tp} ({args.dtype} activations)"
    w4a16_tables.write_table(path, name, table, source)
    print(f"wrote {path}; calls use it when {w4a16_tables.ENV_DIR}={args.out_dir}")
    return 0
