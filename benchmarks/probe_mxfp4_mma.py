"""Probe: the codebook-lookup mma kernel (`kbit/triton/mma.py`, UE8M0 scales, grouped) on
GPT-OSS-20B expert GEMMs at decode sizes, against the default `grouped_gemm` config.

Per token count and GEMM (W13 with the token gather, W2): relative error against fp32 over the
dequantized experts, and time (CUDA-graph replays over 2 weight copies) of lookup-kernel
options on the runtime layout (`mxfp4.layout.pack`), next to the `grouped_gemm` default.
One JSON line per case. (Its first run, `results/mxfp4/probe-mxfp4-mma-*.jsonl`, also timed
the checkpoint's own bytes without the quad interleave, through a kernel flag since removed.)

    python benchmarks/probe_mxfp4_mma.py --out $OUT/probe.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch

from quantfw.kernels import moe, mxfp4
from quantfw.kernels.common.timing import graph_times
from quantfw.kernels.kbit.triton.mma import grouped_lut_mma
from quantfw.kernels.mxfp4 import grouped
from quantfw.kernels.mxfp4.triton import grouped_gemm
from quantfw.kernels.mxfp4.triton import sort as fused

E, TOP_K, H, INTER = 32, 4, 2880, 2880


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument(
        "--pool", type=int, default=E, help="route every token among the first POOL experts"
    )
    args = ap.parse_args()
    dtype = torch.bfloat16
    lut = grouped_gemm.e2m1_lookup_table(torch.device("cuda"), dtype)
    sets = []
    for c in range(2):
        g = torch.Generator(device="cuda").manual_seed(c)
        per = []
        for n, k in ((2 * INTER, H), (H, INTER)):
            w = torch.randn(E, n, k, device="cuda", generator=g) * 0.02
            blocks, scales = mxfp4.quantize(w)
            del w
            per.append(
                dict(
                    n=n,
                    k=k,
                    mx=grouped.Mxfp4Weights.pack(blocks, scales),
                    dense=mxfp4.dequantize(blocks, scales, torch.float32) if c == 0 else None,
                )
            )
        sets.append(per)
    lines = []
    for t in (int(v) for v in args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(100 + t)
        x = torch.randn(t, H, device="cuda", generator=gen).to(dtype)
        logits = torch.randn(t, E, device="cuda", generator=gen)
        logits[:, args.pool :] = -1e4
        _, ids = moe.select_experts(logits.to(dtype), TOP_K, "topk_softmax")
        rows = ids.numel()
        for gi, name in enumerate(("w13", "w2")):
            n, k = sets[0][gi]["n"], sets[0][gi]["k"]
            a = x if gi == 0 else torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
            sort, plan8 = fused.align(ids, E, 8)
            plans = {8: plan8, 16: fused.align(ids, E, 16)[1]}
            gather = sort.token_index if gi == 0 else None
            src = a[gather] if gather is not None else a
            dense = sets[0][gi]["dense"]
            ref = torch.einsum("rk,rnk->rn", src.float(), dense[sort.expert_of_row])
            cfg0 = grouped_gemm.default_config(rows, E, n, k, dtype=dtype)
            _, plan0 = fused.align(ids, E, cfg0["BLOCK_M"])

            def base(s, plan0=plan0, a=a, gather=gather, cfg0=cfg0, gi=gi):
                return lambda: grouped_gemm.grouped_gemm(
                    a, s[gi]["mx"], plan0, gather=gather, config=cfg0
                )

            def lut_call(s, tm, a=a, gather=gather, n=n, gi=gi, plans=plans, **cfg):
                w = s[gi]["mx"]
                return lambda: grouped_lut_mma(
                    a, w.qweight, w.scales, lut, n, plans[tm], gather=gather, ue8m0=True, **cfg
                )

            cases = {"default": [base(s) for s in sets]}
            for tm, copies, cps, chunk in (
                (8, 32, 3, 4), (8, 16, 3, 4), (8, 32, 4, 4), (8, 32, 3, 8),
                (16, 32, 2, 4), (16, 32, 3, 4), (16, 16, 4, 4),
            ):  # fmt: skip
                key = f"lut_tm{tm}_c{copies}_s{cps}_ch{chunk}"
                cases[key] = [
                    lut_call(s, tm, copies=copies, ctas_per_sm=cps, chunk=chunk) for s in sets
                ]
            floor_bytes = len(torch.unique(ids)) * (n * k // 2 + n * k // 32)
            errs = {}
            for key, calls in cases.items():
                try:
                    got = calls[0]().float()
                    torch.cuda.synchronize()
                    errs[key] = ((got - ref).abs().max() / ref.abs().max()).item()
                except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
                    errs[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
            ok = [k_ for k_, e in errs.items() if isinstance(e, float)]
            times = graph_times([cases[k_] for k_ in ok], max(floor_bytes / 4.8e6, 5.0))
            row = {
                "tokens": t,
                "pool": args.pool,
                "gemm": name,
                "floor_us_at_4.8TBps": round(floor_bytes / 4.8e6, 2),
                "us": {k_: round(v, 2) for k_, v in zip(ok, times)},
                "rel_err": errs,
            }
            print(json.dumps(row), flush=True)
            lines.append(json.dumps(row) + "\n")
    with open(args.out, "w") as f:
        f.writelines(lines)


if __name__ == "__main__":
    main()
