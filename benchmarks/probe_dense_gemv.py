"""GPU probe: one token through the dense layers of a batch-1 decode step (GPT-OSS-20B's
attention projections, router and LM head in bf16; Qwen3-8B's projections and LM head in
fp16): cuBLAS (``F.linear`` with the bias) against `kernels.dense.gemv` in a few configs and
the bandwidth floor, with each config's error against a float32 reference. CUDA-graph replays
over weights rotated past L2 (`common.timing`).

    python benchmarks/probe_dense_gemv.py [--configs 4x512c8w2,2x1024c8w4] [--best-out best.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import re

import torch
import torch.nn.functional as F

from quantfw.kernels.common import timing
from quantfw.kernels.dense.gemv import dense_gemv

SHAPES = {  # name: (K, N, bias)
    "gpt-oss qkv": (2880, 5120, True),
    "gpt-oss o": (4096, 2880, True),
    "gpt-oss router": (2880, 32, True),
    "gpt-oss head": (2880, 201088, False),
    "qwen3 qkv": (4096, 6144, False),
    "qwen3 o": (4096, 4096, False),
    "qwen3 gate_up": (4096, 24576, False),
    "qwen3 down": (12288, 4096, False),
    "qwen3 head": (4096, 151936, False),
}


#: dense_gemv configs timed by default, as ``<block_n>x<block_k>c<ctas_per_sm>[w<warps>]``
CONFIGS = "8x512c4,16x256c4,8x256c8w2,4x512c8w2,8x512c4w8,4x512c8w4,2x1024c8w4,8x1024c2w8"


def parse_config(name: str) -> dict:
    """``8x512c4w8`` -> dict(block_n=8, block_k=512, ctas_per_sm=4, warps=8) (warps 4 if
    left out)."""
    m = re.fullmatch(r"(\d+)x(\d+)c(\d+)(?:w(\d+))?", name)
    if m is None:
        raise ValueError(f"config {name!r} is not of the form <block_n>x<block_k>c<ctas>[w<warps>]")
    bn, bk, c, w = m.groups()
    return dict(block_n=int(bn), block_k=int(bk), ctas_per_sm=int(c), warps=int(w or 4))


def _copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (timing.events_median(lambda: dst.copy_(src)) * 1e-6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--copy-bw", type=float, default=0.0, help="bytes/s (0: measure)")
    ap.add_argument("--configs", default=CONFIGS, help="comma-separated, e.g. 8x512c4w8")
    ap.add_argument(
        "--best-out", help="write {'N,K': [fastest config, its us, cuBLAS us]} as JSON here"
    )
    args = ap.parse_args()
    configs = {name: parse_config(name) for name in args.configs.split(",")}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = args.copy_bw or _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    head = " ".join(f"{name:>10}" for name in configs)
    print(f"{'shape':16} {'floor':>7} {'cuBLAS':>8} {head}  (us, one token)  max rel err")
    best = {}
    for name, (K, N, has_bias) in SHAPES.items():
        dtype = torch.bfloat16 if name.startswith("gpt-oss") else torch.float16
        nbytes = N * K * 2
        ws = [
            torch.randn(N, K, device="cuda", dtype=dtype)
            for _ in range(timing.n_copies(nbytes, l2))
        ]
        b = torch.randn(N, device="cuda", dtype=dtype) if has_bias else None
        x = torch.randn(1, K, device="cuda", dtype=dtype)
        ref = x.float() @ ws[0].float().T + (b.float() if has_bias else 0)
        errs = [
            ((dense_gemv(x, ws[0], b, **cfg).float() - ref).abs().max() / ref.abs().max()).item()
            for cfg in configs.values()
        ]
        methods = [[functools.partial(F.linear, x, w, b) for w in ws]]
        methods += [
            [functools.partial(dense_gemv, x, w, b, **c) for w in ws] for c in configs.values()
        ]
        times = timing.graph_times(methods, timing.rough_time_us(nbytes, 1, N, K))
        floor = nbytes / bw * 1e6
        print(
            f"{name:16} {floor:7.1f} "
            + " ".join(f"{t:8.1f}  " for t in times)
            + f"  {max(errs):.1e}",
            flush=True,
        )
        del ws
        fastest = min(range(len(configs)), key=lambda i: times[1 + i])
        best[f"{N},{K}"] = [list(configs)[fastest], times[1 + fastest], times[0]]
    if args.best_out:
        with open(args.best_out, "w") as f:
            json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
