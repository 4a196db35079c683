"""Where a decode step's GPU time goes: torch.profiler over CUDA-graph decode steps of a
Qwen3-8B-shaped model (dummy weights), kernels grouped by kind, next to the step's wall time and
the bandwidth floor (weight bytes / measured copy bandwidth).

    python benchmarks/profile_decode.py --layers 36 --methods fp16,awq,kbit4 --batch-sizes 1,16
    QUANTFW_PDL=0 python benchmarks/profile_decode.py --methods fp16,kbit4 --profile-batch 16

(The kernel and host profiles are of ``--profile-batch`` sequences of ``--decode-context``
prompt tokens each. With programmatic dependent launch on, a kernel's time includes its wait for the previous
one: profile with ``QUANTFW_PDL=0``.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections import defaultdict

import torch

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QUANT = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
}  # fmt: skip

KINDS = [
    ("attention", r"paged_decode|merge_splits|paged_prefill|flash|fmha|sdpa|attention"),
    ("kv store", r"store_kv|index_copy|scatter"),
    ("rmsnorm", r"rms_norm"),
    ("rope", r"qk_norm_rope|rope"),
    ("silu*mul", r"silu"),
    ("all-reduce", r"nccl|allreduce|all_reduce"),
    ("kbit", r"kbit"),
    ("w4a16", r"w4a16|mma|wgmma|ring|dequant"),
    ("gemm", r"gemm|gemv|cutlass|sm90|xmma|cublas|splitK|Kernel2"),
    ("copy/index", r"copy|index|gather|elementwise|fill|cat|arange"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - start)
    del x, y
    return bw


def make_model_dir(root: str, layers: int, method: str) -> str:
    path = os.path.join(root, f"{method}-{layers}")
    os.makedirs(path, exist_ok=True)
    config = {**QWEN3_8B, "num_hidden_layers": layers}
    if method in QUANT:
        config["quantization_config"] = QUANT[method]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter and buffer except the input embedding."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" in name or "rotary" in name:
            continue
        total += t.numel() * t.element_size()
    return total


def _all_decoding(engine) -> bool:
    """Every request is running and its next step decodes one token (its prompt is done)."""
    sched = engine.scheduler
    return not sched.waiting and all(s.num_uncomputed == 1 for s in sched.running)


def decode_rate(engine, batch: int, prompt_len: int, new_tokens: int) -> float:
    from quantfw.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(torch.randint(10, 150000, (prompt_len,), generator=g).tolist(), params)
    tokens, elapsed = 0, 0.0
    while engine.has_unfinished():
        decoding = _all_decoding(engine)
        n = len(engine.scheduler.running)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        if decoding:
            elapsed += time.perf_counter() - start
            tokens += n
    return tokens / elapsed


def prefill_ms(engine, prompt_len: int) -> float:
    from quantfw.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = torch.randint(10, 150000, (prompt_len,)).tolist()
    times = []
    for _ in range(3):
        engine.add_request(ids, params)
        torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def _decoding_batch(engine, batch: int, steps: int, prompts: list[list[int]] | None) -> None:
    """Starts `batch` greedy requests that outlive `steps` more steps, then steps through their
    prefill (in as many chunks as the scheduler takes) and a few decode steps; every sequence's
    prompt is tokens 100..227 unless `prompts` (one per sequence) are given."""
    from quantfw.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(prompts[i] if prompts else list(range(100, 228)), params)
    while not _all_decoding(engine):  # the prefill
        engine.step()
    for _ in range(3):  # a few decode steps
        engine.step()
    torch.cuda.synchronize()


def profiled_decode(engine, batch: int, steps: int, prompts: list[list[int]] | None = None):
    """torch.profiler (CUDA activity) of `steps` decode steps of a batch (`_decoding_batch`).
    The requests run to their end afterwards."""
    from torch.profiler import ProfilerActivity, profile

    _decoding_batch(engine, batch, steps, prompts)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    return prof


def profile_steps(
    engine, batch: int, steps: int = 20, prompts: list[list[int]] | None = None
) -> dict[str, float]:
    """GPU microseconds per decode step by kernel kind (`profiled_decode`)."""
    prof = profiled_decode(engine, batch, steps, prompts)
    by_kind: dict[str, float] = defaultdict(float)
    names: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t <= 0 or evt.key.startswith("ProfilerStep"):
            continue
        by_kind[kind_of(evt.key)] += t / steps
        names[evt.key[:90]] += t / steps
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    return {"by_kind_us": dict(by_kind), "top_kernels_us": dict(top)}


def host_profile(
    engine, batch: int, steps: int = 50, prompts: list[list[int]] | None = None
) -> None:
    """cProfile of decode steps of a batch (`_decoding_batch`): where the host's time goes (the
    GPU wait shows in tolist)."""
    import cProfile
    import pstats

    _decoding_batch(engine, batch, steps, prompts)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    wall = (time.perf_counter() - start) / steps * 1e6
    while engine.has_unfinished():
        engine.step()
    print(f"host profile bs={batch}: {wall:.0f} us per step (cProfile on)", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--methods", default="fp16,awq")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-model-lens", default="4096,40960")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--out", default=None)
    ap.add_argument("--host-profile", action="store_true", help="also cProfile decode steps")
    ap.add_argument(
        "--decode-window", type=int, default=1, help="1: the kernel profile is per decode step"
    )
    ap.add_argument(
        "--profile-batch", type=int, default=1, help="batch of the kernel and host profiles"
    )
    ap.add_argument(
        "--decode-context", type=int, default=128, help="prompt tokens of each decode sequence"
    )
    args = ap.parse_args()
    from quantfw.engine import LLMEngine

    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    report = {"device": torch.cuda.get_device_name(), "copy_bw": bw, "runs": []}
    lens = [int(x) for x in args.max_model_lens.split(",")]
    with tempfile.TemporaryDirectory() as root:
        for method in args.methods.split(","):
            path = make_model_dir(root, args.layers, method)
            for max_len in lens:
                t0 = time.perf_counter()
                kbit = re.fullmatch(r"kbit(\d)(-head)?", method)  # quantized while loading
                quant = (
                    {
                        "quantization": "kbit",
                        "quantization_args": {"bits": int(kbit[1]), "lm_head": bool(kbit[2])},
                    }
                    if kbit
                    else {}
                )
                engine = LLMEngine(
                    path, dtype="float16", load_format="dummy", max_model_len=max_len,
                    max_num_seqs=16, tokenizer=None, gpu_memory_utilization=0.85,
                    decode_window=args.decode_window, **quant,
                )  # fmt: skip
                load_s = time.perf_counter() - t0
                wb = weight_bytes(engine.model)
                floor = bw / wb
                row = {"method": method, "max_model_len": max_len, "load_s": round(load_s, 1),
                       "weight_gib": wb / 2**30, "floor_tok_s": floor}  # fmt: skip
                for b in [int(x) for x in args.batch_sizes.split(",")]:
                    decode_rate(engine, b, 16, 8)  # warm-up
                    rate = decode_rate(engine, b, args.decode_context, 64)
                    row[f"decode_bs{b}"] = rate
                    print(
                        f"{method} max_len={max_len} bs={b}: {rate:.1f} tok/s"
                        + (f" ({rate / floor:.2f} of floor {floor:.0f})" if b == 1 else ""),
                        flush=True,
                    )
                if max_len == lens[0]:
                    row["prefill_ms"] = prefill_ms(engine, args.prompt_len)
                    print(
                        f"{method} prefill {args.prompt_len}: {row['prefill_ms']:.1f} ms",
                        flush=True,
                    )
                    pb = args.profile_batch
                    ctx = args.decode_context
                    prompts = [[100 + (i + t) % 50000 for t in range(ctx)] for i in range(pb)]
                    prof = row[f"profile_bs{pb}"] = profile_steps(engine, pb, prompts=prompts)
                    kinds = sorted(prof["by_kind_us"].items(), key=lambda kv: -kv[1])
                    total = sum(v for _, v in kinds)
                    print(f"{method} bs{pb} GPU us/step {total:.0f}: " + ", ".join(
                        f"{k} {v:.0f}" for k, v in kinds), flush=True)  # fmt: skip
                    for name, us in prof["top_kernels_us"].items():
                        print(f"    {us:8.1f} us  {name}", flush=True)
                    if args.host_profile:
                        host_profile(engine, pb, prompts=prompts)
                report["runs"].append(row)
                print(f"  (load {load_s:.1f} s, weights {wb / 2**30:.2f} GiB)", flush=True)
                del engine
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
