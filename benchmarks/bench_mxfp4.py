"""MXFP4 mixture-of-experts on one GPU: GPT-OSS-20B's expert shapes (E=32, top-4, H=2880,
I=2880), one whole MoE layer for 1..4096 tokens.

For each token count, random router logits pick the experts; each method's full MoE layer
(sort, W13 GEMM + bias, SwiGLU, W2 GEMM + bias, combine) is checked against the
dequantize-per-expert reference, then timed as CUDA-graph replays over weight copies rotated so
L2 holds none (``kernels.common.timing``). Methods: our Triton kernels with MXFP4 experts, the
same kernels with bf16 experts (the grouped baseline), with ``--flashinfer`` FlashInfer's
CUTLASS fused MoE on the same MXFP4 experts (SM90, bf16; `kernels.mxfp4.flashinfer_sm90`) and,
with ``--sweep``, the best of a grid of kernel configs for each (a few minutes per token
count). The floor is the time to read the
experts actually routed to (MXFP4 blocks, scales and biases of each distinct expert, once) at
the device's measured copy bandwidth. Targets (issue 19): decode (<= 16 tokens) within 1.5x the
floor, prefill no slower than bf16.

The whole model end to end is `quantfw bench gpt-oss-20b --methods fp16,mxfp4 --dtype bfloat16`
(MXFP4 experts against the bf16-expert twin).

    python benchmarks/bench_mxfp4.py --out $OUT/mxfp4-layer.json [--sweep] [--sweep-tokens 1,4096]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os

import torch

from quantfw.kernels import moe, mxfp4
from quantfw.kernels.common import is_sm90
from quantfw.kernels.common.timing import events_median, graph_times
from quantfw.kernels.fused import swiglu_oai
from quantfw.kernels.mxfp4 import grouped
from quantfw.kernels.mxfp4.triton import grouped_gemm

E, TOP_K, H, INTER = 32, 4, 2880, 2880
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
LUT_SWEEP = [
    dict(BLOCK_M=bm, LUT=True, copies=c, ctas_per_sm=s, chunk=ch)
    for bm, c, s, ch in itertools.product((8, 16), (16, 32), (3, 4), (4, 8))
]
DECODE_SWEEP = [
    dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3, SWAP=True)
    for bn, bk in itertools.product((32, 64, 128), (128, 256))
    if bn * bk <= 16384
]
PREFILL_SWEEP = [
    dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, **kind)
    for bm, kind in itertools.product((64, 128), ({}, {"SWAP": True}, {"DEQUANT": True}))
] + [dict(BLOCK_M=bm, WGMMA=True, stages=s) for bm, s in ((64, 4), (128, 3), (128, 4), (256, 3))]


def sweep_for(rows_per_expert: float, quantized: bool, default: dict | None = None) -> list[dict]:
    """The configs worth timing for `rows_per_expert` (LUT, DEQUANT and WGMMA only for MXFP4
    weights), `default` (the config the layer picks) first, so that the best of a sweep is
    never one slower than the layer's own choice."""
    if rows_per_expert <= 16:
        grid = LUT_SWEEP + DECODE_SWEEP
    else:
        grid = PREFILL_SWEEP
    grid = [
        c for c in grid if quantized or not (c.get("LUT") or c.get("DEQUANT") or c.get("WGMMA"))
    ]
    return grid if default is None else [default] + [c for c in grid if c != default]


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    src = torch.empty(2**30, dtype=torch.uint16, device="cuda")
    dst = torch.empty_like(src)
    us = events_median(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() * 2 / (us * 1e-6)


def make_experts(dtype: torch.dtype, copies: int, seed: int = 0, flashinfer: bool = False):
    """`copies` sets of ((MXFP4 W13, MXFP4 W2), b13, b2) of random experts, and with
    `flashinfer` the same experts prepared for FlashInfer's SM90 fused MoE (else Nones)."""
    from quantfw.kernels.fused import GatedAct

    out, fi = [], []
    for c in range(copies):
        g = torch.Generator(device="cuda").manual_seed(seed + c)
        w13 = torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * 0.02
        w2 = torch.randn(E, H, INTER, device="cuda", generator=g) * 0.02
        b13 = torch.randn(E, 2 * INTER, device="cuda", generator=g).to(dtype) * 0.1
        b2 = torch.randn(E, H, device="cuda", generator=g).to(dtype) * 0.1
        q13, q2 = mxfp4.quantize(w13), mxfp4.quantize(w2)
        del w13, w2
        mx = (grouped.Mxfp4Weights.pack(*q13), grouped.Mxfp4Weights.pack(*q2))
        out.append((mx, b13, b2))
        fi.append(None)
        if flashinfer:
            from quantfw.kernels.mxfp4 import flashinfer_sm90 as fs

            padded = fs.pad_experts(*q13, *q2, b13, b2)
            fi[-1] = fs.Sm90Experts.prepare(padded, GatedAct("swiglu_oai", 1.702, 7.0))
            picks = fs.pick_tactics(fi[-1], TOP_K)  # timed once per shape
            if c == 0:
                print(f"FlashInfer tactics (gemm1, gemm2) by tokens: {picks}", flush=True)
    return out, fi


def expert_bytes_mxfp4() -> int:
    """Blocks, scales and bf16 biases of one expert (W13 and W2)."""
    weights = 2 * INTER * H + H * INTER
    return weights // 2 + weights // 32 + (2 * INTER + H) * 2


def _act(y: torch.Tensor) -> torch.Tensor:
    return swiglu_oai(y, 1.702, 7.0)


def _layer(x, weights, ids, w13, w2, b13, b2, config=None):
    """One call of the whole MoE layer, as a zero-argument function."""
    return lambda: grouped.moe_forward(
        x, weights, ids, w13=w13, w2=w2, w13_bias=b13, w2_bias=b2, activation=_act, config=config
    )


def bench_tokens(t: int, dtype, copies, dense, fi, bw: float, sweep: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, H, device="cuda", generator=g).to(dtype)
    logits = torch.randn(t, E, device="cuda", generator=g)
    weights, ids = moe.select_experts(logits.to(dtype), TOP_K, "topk_softmax")
    distinct = int(torch.unique(ids).numel())
    floor_us = distinct * expert_bytes_mxfp4() / bw * 1e6
    (mx13, mx2), b13, b2 = copies[0]
    d13, d2 = dense[0][0].weight, dense[0][1].weight
    ref = moe.experts_forward_cpu(
        x.float(), weights.float(), ids, num_experts=E,
        expert_weights=lambda e: (d13[e].float(), d2[e].float()),
        activation=_act, w13_bias=b13.float(), w2_bias=b2.float(),
    )  # fmt: skip

    def err(fn) -> float:
        return ((fn().float() - ref).abs().max() / ref.abs().max()).item()

    mx_calls = [_layer(x, weights, ids, *c[0], c[1], c[2]) for c in copies]
    bf_calls = [_layer(x, weights, ids, *c) for c in dense]
    est = max(floor_us, 20.0)
    groups = [mx_calls, bf_calls]
    if fi[0] is not None:
        from quantfw.kernels.mxfp4 import flashinfer_sm90

        picks = flashinfer_sm90.tactics_for(flashinfer_sm90.pick_tactics(fi[0], TOP_K), t)
        groups.append(
            [lambda f=f: flashinfer_sm90.moe_forward(x, weights, ids, f, picks) for f in fi]
        )
        default = [lambda f=f: flashinfer_sm90.moe_forward(x, weights, ids, f) for f in fi]
        groups.append(default)
    mx_us, bf_us, *fi_us = graph_times(groups, est)
    row = {
        "tokens": t,
        "distinct_experts": distinct,
        "default_config": grouped_gemm.default_config(
            t * TOP_K, E, 2 * INTER, H, dtype=dtype, hopper=is_sm90(x.device)
        ),
        "mxfp4_us": round(mx_us, 2),
        "bf16_us": round(bf_us, 2),
        "floor_us": round(floor_us, 2),
        "mxfp4_over_floor": round(mx_us / floor_us, 3),
        "bf16_over_mxfp4": round(bf_us / mx_us, 3),
        "mxfp4_rel_err": err(mx_calls[0]),
        "bf16_rel_err": err(bf_calls[0]),
    }
    if fi_us:
        row["flashinfer_tactics"] = picks
        row["flashinfer_default_tactics_us"] = round(fi_us[1], 2)
        row["flashinfer_us"] = round(fi_us[0], 2)
        row["flashinfer_over_floor"] = round(fi_us[0] / floor_us, 3)
        row["flashinfer_over_mxfp4"] = round(fi_us[0] / mx_us, 3)
        row["flashinfer_rel_err"] = err(groups[2][0])
    if sweep:
        for name, sets in (("mxfp4", [(*c[0], c[1], c[2]) for c in copies]), ("bf16", dense)):
            quantized = name == "mxfp4"
            default = grouped_gemm.default_config(
                t * TOP_K, E, 2 * INTER, H, mxfp4=quantized, dtype=dtype, hopper=is_sm90(x.device)
            )
            best = _best_config(
                sweep_for(t * TOP_K / min(E, t * TOP_K), quantized, default),
                lambda cfg, sets=sets: [_layer(x, weights, ids, *w, config=cfg) for w in sets],
                err,
                est,
            )
            if best is not None:
                row[f"{name}_sweep_best_us"], row[f"{name}_sweep_best_config"] = best
        if "mxfp4_sweep_best_us" in row:
            row["mxfp4_sweep_best_over_floor"] = round(row["mxfp4_sweep_best_us"] / floor_us, 3)
    return row


def _best_config(configs: list[dict], calls_for, err, est: float):
    """(time, config) of the fastest correct one of `configs`, or None."""
    best = None
    for cfg in configs:
        calls = calls_for(cfg)
        try:
            if err(calls[0]) > 3e-2:
                print(f"  wrong result with {cfg}", flush=True)
                continue
            (us,) = graph_times([calls], est, rounds=3)
        except Exception as exc:  # a config this GPU cannot run (shared memory)
            print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
            continue
        if best is None or us < best[0]:
            best = (round(us, 2), cfg)
    return best


def layer_bench(args) -> dict:
    dtype = getattr(torch, args.dtype)
    bw = copy_bandwidth()
    copies, fi = make_experts(dtype, 2, flashinfer=args.flashinfer)
    dense = [
        (
            grouped.dequantize_dense(mx13, dtype),
            grouped.dequantize_dense(mx2, dtype),
            b13,
            b2,
        )
        for (mx13, mx2), b13, b2 in copies
    ]
    rows = []
    for t in args.tokens:
        rows.append(bench_tokens(t, dtype, copies, dense, fi, bw, t in args.sweep_tokens))
        print(json.dumps(rows[-1]), flush=True)
    return {"bandwidth_GBps": round(bw / 1e9, 1), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mxfp4.json"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--sweep", action="store_true", help="also time a grid of kernel configs")
    ap.add_argument(
        "--flashinfer",
        action="store_true",
        help="also time FlashInfer's SM90 CUTLASS fused MoE (bfloat16, needs flashinfer)",
    )
    ap.add_argument(
        "--sweep-tokens", default=None, help="token counts to sweep (default: all of --tokens)"
    )
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    picked = args.sweep_tokens.split(",") if args.sweep_tokens else args.tokens
    args.sweep_tokens = {int(t) for t in picked} if args.sweep else set()
    report = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "dtype": args.dtype,
        "shapes": {"experts": E, "top_k": TOP_K, "hidden": H, "intermediate": INTER},
    }
    report.update(layer_bench(args))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
