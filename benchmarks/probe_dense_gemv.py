"""GPU probe: one token through the dense layers of a batch-1 decode step (GPT-OSS-20B's
attention projections, router and LM head in bf16; Qwen3-8B's in fp16): cuBLAS (``F.linear``
with the bias) against `kernels.dense.gemv` in a few configs and the bandwidth floor, with
each config's error against a float32 reference. CUDA-graph replays over weights rotated past
L2 (`common.timing`).

    python benchmarks/probe_dense_gemv.py
"""

from __future__ import annotations

import argparse
import functools

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
}


#: dense_gemv configs: (block_n, block_k, ctas_per_sm, warps)
CONFIGS = {
    "32x512c4": dict(block_n=32, block_k=512, ctas_per_sm=4),
    "16x512c4": dict(block_n=16, block_k=512, ctas_per_sm=4),
    "64x256c4": dict(block_n=64, block_k=256, ctas_per_sm=4),
    "32x1024c2": dict(block_n=32, block_k=1024, ctas_per_sm=2, warps=8),
    "16x256c8": dict(block_n=16, block_k=256, ctas_per_sm=8),
    "8x512c8": dict(block_n=8, block_k=512, ctas_per_sm=8),
}


def _copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (timing.events_median(lambda: dst.copy_(src)) * 1e-6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--copy-bw", type=float, default=0.0, help="bytes/s (0: measure)")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = args.copy_bw or _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    head = " ".join(f"{name:>10}" for name in CONFIGS)
    print(f"{'shape':16} {'floor':>7} {'cuBLAS':>8} {head}  (us, one token)  max rel err")
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
            for cfg in CONFIGS.values()
        ]
        methods = [[functools.partial(F.linear, x, w, b) for w in ws]]
        methods += [
            [functools.partial(dense_gemv, x, w, b, **c) for w in ws] for c in CONFIGS.values()
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


if __name__ == "__main__":
    main()
