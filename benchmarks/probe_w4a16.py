"""Probes behind experiments 23-25 of benchmarks/w4a16-lab-log.md (CUDA only).

  python benchmarks/probe_w4a16.py splits  SHAPES M CONFIG...   # wg configs x forced split-K
  python benchmarks/probe_w4a16.py configs SHAPES M CONFIG...   # any kernel configs
  python benchmarks/probe_w4a16.py overhead                     # fixed cost per call, M = 1
  python benchmarks/probe_w4a16.py deq     SHAPES M[,M...]      # the deq path, step by step

SHAPES: comma-separated names from bench_w4a16.SHAPES, or ``all``; CONFIG: a config tuple
as a Python literal, e.g. '("wg", 256, 2, 4, 4, 1)'.  Times are CUDA-graph replays over
rotated weight copies (bench_w4a16's timer); every timed config is also checked twice against
the fp32 reference, so a workspace left dirty by split-K would show as an error.
"""

from __future__ import annotations

import ast
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))

import bench_w4a16 as B  # noqa: E402

from quantfw.kernels.w4a16.triton import dispatch as TK  # noqa: E402
from quantfw.kernels.w4a16.triton import wgmma as WGM  # noqa: E402
from quantfw.kernels.w4a16.triton.mma import split_plan  # noqa: E402


def _forced_plan(split: int):
    """The wg planner with ``split`` CTAs per tile along K (one tile per 'SM', one CTA each)."""

    def plan(stages, tiles, sms, ctas_per_sm):
        return split_plan(stages, 1, split, 1, even=True)

    return plan


def _weights(K, N, l2):
    int4 = B.packed_bytes(K, N, B.G)
    return int4, [B.random_awq(K, N, B.G, "cuda") for _ in range(B.n_copies(int4, l2))]


def _fp16_weights(K, N, l2):
    """Enough random fp16 ``[N, K]`` copies to rotate past L2."""
    return [
        torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        for _ in range(B.n_copies(K * N * 2, l2))
    ]


def _shapes(names):
    return [(n, K, N) for n, K, N in B.SHAPES if names == ["all"] or n in names]


def probe_configs(names, M, cfgs, splits):
    copy_bw, mm_rate = B.measure_ceilings()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(
        f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s, mm {mm_rate / 1e12:.0f} TFLOP/s"
    )
    planner = WGM._plan
    for name, K, N in _shapes(names):
        int4, packs = _weights(K, N, l2)
        fw = _fp16_weights(K, N, l2)
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        floor = max((int4 + M * K * 2 + M * N * 2) / copy_bw, 2 * M * N * K / mm_rate) * 1e6
        fp16 = B.graph_time([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in fw], floor)
        timer = B.rotated_timer(x, packs, floor)
        ref = x.float() @ B.W.dequantize_packed(packs[0], torch.float32)
        print(f"{name:22s} M={M} fp16 {fp16:.1f} floor {floor:.1f}", flush=True)
        for cfg in cfgs:
            for split in splits:
                WGM._plan = planner if split is None else _forced_plan(split)
                try:
                    t = timer(cfg)
                    err = max(
                        ((TK.w4a16_matmul_cuda(x, packs[0], config=cfg).float() - ref).norm()
                         / ref.norm()).item()
                        for _ in range(2)
                    )  # fmt: skip
                    print(f"    {cfg[1:]} split {split or 'planned'}: {t:.1f} us, err {err:.1e}")
                except Exception as e:  # a config the compiler rejects
                    print(f"    {cfg[1:]} split {split or 'planned'}: failed {e!r:.120}")
                finally:
                    WGM._plan = planner
        del packs, fw
        torch.cuda.empty_cache()


@triton.jit
def _empty(p):
    pass


def probe_overhead():
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sink = torch.zeros(64, device="cuda", dtype=torch.int32)
    print(f"{torch.cuda.get_device_name()}")
    print(f"empty kernel, 1 CTA: {B.graph_time([lambda: _empty[(1,)](sink)], 2.0):.2f} us")
    t = B.graph_time([lambda: _empty[(1056,)](sink, num_warps=4)], 2.0)
    print(f"empty kernel, 1056 CTAs: {t:.2f} us")
    for name, K, N in B.SHAPES:
        if name not in ("qwen3-8b.o", "qwen3-8b.gate_up", "llama3-70b-tp8.o"):
            continue
        int4, packs = _weights(K, N, l2)
        t_read = B.plain_read_us(int4, len(packs), 2.0)
        x = torch.randn(1, K, device="cuda", dtype=torch.float16)
        timer = B.rotated_timer(x, packs, 2.0)
        best = min((timer(c), c) for c in TK.candidate_configs(1, True))
        print(
            f"{name:20s} {int4 / 1e6:6.2f} MB: read-only kernel {t_read:6.2f} us "
            f"({int4 / t_read / 1e6:.2f} TB/s), ours {best[0]:6.2f} us {best[1]}",
            flush=True,
        )


def probe_deq(names, Ms):
    """The ``deq`` path taken apart: cuBLAS on cold weights in both layouts (``F.linear`` on
    ``[N, K]``, ``mm`` on ``[K, N]``), the dequantization kernel alone, and the whole path."""
    F = torch.nn.functional
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name())
    for name, K, N in _shapes(names):
        int4, packs = _weights(K, N, l2)
        w_nk = _fp16_weights(K, N, l2)
        w_kn = [w.t().contiguous() for w in w_nk]
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            ref = x.float() @ B.W.dequantize_packed(packs[0], torch.float32)
            est = 2 * M * N * K / 700e12 * 1e6 + 5
            row = [
                f"linear[N,K] {B.graph_time([lambda w=w, x=x: F.linear(x, w) for w in w_nk], est):.1f}",
                f"mm[K,N] {B.graph_time([lambda w=w, x=x: torch.mm(x, w) for w in w_kn], est):.1f}",
            ]
            for cfg in TK.candidate_configs(1024):
                _, bkb, warps = cfg

                def deq(p, bkb=bkb, warps=warps):
                    return TK._dequantize(p, torch.float16, bkb, warps)

                t_deq = B.graph_time([lambda p=p, d=deq: d(p) for p in packs], 5.0)
                t_all = B.rotated_timer(x, packs, est)(cfg)
                out = TK.w4a16_matmul_cuda(x, packs[0], config=cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                row.append(f"deq{cfg[1:]} {t_deq:.1f}, +linear {t_all:.1f}, err {err:.0e}")
            print(f"{name:20s} M={M:5d} " + " | ".join(row), flush=True)
        del packs, w_nk, w_kn
        torch.cuda.empty_cache()


def main():
    if sys.argv[1] == "overhead":
        return probe_overhead()
    if sys.argv[1] == "deq":
        return probe_deq(sys.argv[2].split(","), [int(m) for m in sys.argv[3].split(",")])
    names, M = sys.argv[2].split(","), int(sys.argv[3])
    cfgs = [tuple(ast.literal_eval(c)) for c in sys.argv[4:]]
    splits = [None, 1, 2, 3, 4, 6, 8] if sys.argv[1] == "splits" else [None]
    probe_configs(names, M, cfgs, splits)


if __name__ == "__main__":
    main()
