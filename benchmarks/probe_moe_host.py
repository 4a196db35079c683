"""Host time of one MoE layer's eager call (GPT-OSS-20B's expert shapes), against its GPU time.

A prefill runs every layer eagerly, so each launch's Python and driver work (argument binding,
TMA descriptors, workspace and plan tensors) is paid once per layer and prompt; when it exceeds
the kernels' time the host sets a prefill's pace (found for GPT-OSS-20B MXFP4 on 2026-11-27:
`benchmarks/mxfp4-lab-log.md` §30). For each token count this times, per call: the host (a
loop of calls without synchronising, few enough that the launch queue never fills) and the GPU
(CUDA events around the same loop once the queue drained: where the host is the slower side
this reads the host's pace), for the whole layer and its parts, MXFP4 experts with the weights
wrapped once (as a layer keeps them) or anew each call, and bf16 experts. Host figures move by
up to 2x between machines of one pool (mxfp4-lab-log §30): compare rows of one run.

    python benchmarks/probe_moe_host.py [--tokens 16,512,2048] [--cprofile "lookup W13" --top 25]

``--cprofile NAME``: the rows whose name contains NAME also run 100 calls under cProfile, and
their top Python functions by own time are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from functools import partial

import torch

from quantfw.kernels import moe, mxfp4
from quantfw.kernels.common import is_sm90
from quantfw.kernels.mxfp4 import grouped
from quantfw.kernels.mxfp4.triton import grouped_gemm, wgmma
from quantfw.kernels.mxfp4.triton import sort as sort_kernels
from quantfw.layers.activation import SwigluOAIAndMul

E, TOP_K, H, INTER = 32, 4, 2880, 2880


def host_and_gpu_us(fn, calls: int = 12, repeats: int = 5) -> tuple[float, float]:
    """(host us per call: median over `repeats` loops of `calls` unsynchronised calls, GPU us
    per call: CUDA events around `calls` calls after the host loop drained)."""
    fn()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        gpu.append(begin.elapsed_time(end) * 1e3 / calls)
    return sorted(host)[repeats // 2], sorted(gpu)[repeats // 2]


def cprofile_calls(fn, calls: int, top: int) -> str:
    """The top `top` functions by own time over `calls` calls of `fn`."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    text = out.getvalue()
    return text[text.index("ncalls") :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="16,512,2048")
    ap.add_argument("--cprofile", default=None, help="profile the rows whose name holds this")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * 0.02
    w2 = torch.randn(E, H, INTER, device="cuda", generator=g) * 0.02
    b13 = (torch.randn(E, 2 * INTER, device="cuda", generator=g) * 0.1).bfloat16()
    b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.1).bfloat16()
    q13, q2 = mxfp4.quantize(w13), mxfp4.quantize(w2)
    kept13, kept2 = grouped.Mxfp4Weights.pack(*q13), grouped.Mxfp4Weights.pack(*q2)
    dense13, dense2 = grouped.DenseWeights(w13.bfloat16()), grouped.DenseWeights(w2.bfloat16())
    del w13, w2
    act = SwigluOAIAndMul()
    print(f"device {torch.cuda.get_device_name()}; us per call, host / GPU")
    for t in (int(s) for s in args.tokens.split(",")):
        x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
        logits = torch.randn(t, E, device="cuda", generator=g).bfloat16()
        weights, ids = moe.select_experts(logits, TOP_K, "topk_softmax")

        def layer(w_13, w_2, fresh=False, x=x, weights=weights, ids=ids):
            def call():
                a, b = w_13, w_2
                if fresh:  # a new wrapper each call, as `_packed` built them
                    a = grouped.Mxfp4Weights(a.qweight, a.scales, a.n, a.k)
                    b = grouped.Mxfp4Weights(b.qweight, b.scales, b.n, b.k)
                return grouped.moe_forward(
                    x, weights, ids, w13=a, w2=b, w13_bias=b13, w2_bias=b2, activation=act
                )

            return call

        cfg = grouped_gemm.default_config(
            t * TOP_K, E, 2 * INTER, H, mxfp4=True, dtype=x.dtype, hopper=is_sm90(x.device)
        )
        sort, plan = grouped._sort(ids, E, cfg["BLOCK_M"])
        rows = {
            "mxfp4 layer, weights kept": layer(kept13, kept2),
            "mxfp4 layer, weights wrapped each call": layer(kept13, kept2, fresh=True),
            "bf16 layer": layer(dense13, dense2),
            "router top-k": partial(moe.select_experts, logits, TOP_K, "topk_softmax"),
            "sort and block plan": partial(grouped._sort, ids, E, cfg["BLOCK_M"]),
            "combine": partial(sort_kernels.combine, x.repeat_interleave(TOP_K, 0), sort, weights),
        }
        if cfg.get("WGMMA"):
            xs = wgmma.input_order(x, sort.token_index)
            rows["wgmma input order"] = partial(wgmma.input_order, x, sort.token_index)
            rows["wgmma W13, weights kept"] = partial(
                wgmma.grouped_gemm, xs, kept13, plan, bias=b13, **wgmma.options(cfg)
            )
        else:
            rows["lookup W13, weights kept"] = partial(
                grouped_gemm.grouped_gemm, x, kept13, plan, bias=b13, gather=sort.token_index,
                config=cfg,
            )  # fmt: skip
        for name, fn in rows.items():
            host, gpu = host_and_gpu_us(fn)
            print(f"T={t:5d}  {name:40s} host {host:8.1f}  GPU {gpu:8.1f}", flush=True)
            if args.cprofile and args.cprofile in name:
                print(cprofile_calls(fn, 100, args.top), flush=True)


if __name__ == "__main__":
    main()
