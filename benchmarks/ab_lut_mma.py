"""A/B probe of the codebook-lookup mma kernel (`kbit/triton/mma.py`): the current module
against another copy of it (``--baseline FILE``, e.g. ``git show REV:quantfw/kernels/kbit/
triton/mma.py > /tmp/base.py``), timed side by side in one run (CUDA-graph replays, weights
rotated past L2), each checked against the fp32 reference first.

Cases: kbit K = 2 and 4 on the Qwen3-8B linear shapes at 1, 4 and 16 tokens (the default mma
config), and MXFP4 grouped GEMMs on GPT-OSS-20B expert shapes (W13 with the token gather, W2)
at 1, 4, 16 tokens (uniform routing) and 16 tokens routed among 4 experts. ``--variants``
adds options of the current kernel (``tm16``: 16-token row blocks; ``nreg168``: a 168-register
cap, three 4-warp CTAs per SM). One JSON line per case.

    python benchmarks/ab_lut_mma.py --baseline /tmp/base.py --out $OUT/ab.jsonl
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json

import torch

from quantfw.kernels import moe, mxfp4
from quantfw.kernels.common import timing
from quantfw.kernels.kbit import configs, layout
from quantfw.kernels.kbit.triton import mma as current
from quantfw.kernels.kbit.triton.tuning import random_kbit
from quantfw.kernels.mxfp4 import grouped
from quantfw.kernels.mxfp4.triton import grouped_gemm
from quantfw.kernels.mxfp4.triton import sort as fused

QWEN3_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
E, TOP_K, H, INTER = 32, 4, 2880, 2880


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("baseline_mma", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm()).item()


def kbit_rows(kernels: dict, variants: list[str], l2: int):
    for (name, (K, N)), bits, M in (
        (s, b, m) for s in QWEN3_8B.items() for b in (4, 2) for m in (1, 4, 16)
    ):
        nbytes = layout.tiled_nbytes(N, K, bits)
        ws = [random_kbit(N, K, bits, "cuda") for _ in range(timing.n_copies(nbytes, l2))]
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        _, warps, chunk, ctas, copies, pipe = configs.default_config(M, N, K, bits)
        opts = dict(warps=warps, chunk=chunk, ctas_per_sm=ctas, copies=copies, pipe=pipe)
        cases = {key: (mod, opts) for key, mod in kernels.items()}
        if "nreg168" in variants and M > 8:
            cases["current_nreg168"] = (kernels["current"], {**opts, "maxnreg": 168})
        ref = x.float() @ layout.dequantize_weight(ws[0], torch.float32).t()
        errs, methods = {}, {}
        for key, (mod, o) in cases.items():
            lut = mod.lookup_table(ws[0].codebook, bits, x.dtype)
            fns = [
                functools.partial(
                    mod.kbit_mma_matmul, x, w.qweight, w.scales, lut, N, bits, None, **o
                )
                for w in ws
            ]
            errs[key] = rel_err(fns[0](), ref)
            methods[key] = fns
        times = timing.graph_times(list(methods.values()), nbytes / 4e6)
        yield {
            "kind": "kbit", "shape": name, "bits": bits, "M": M,
            "floor_us_at_4.8TBps": round(nbytes / 4.8e6, 2),
            "us": {k: round(t, 2) for k, t in zip(methods, times)}, "rel_err": errs,
        }  # fmt: skip


def mxfp4_rows(kernels: dict, variants: list[str]):
    dtype = torch.bfloat16
    weights = []
    for c in range(2):
        g = torch.Generator(device="cuda").manual_seed(c)
        per = []
        for n, k in ((2 * INTER, H), (H, INTER)):
            blocks, scales = mxfp4.quantize(torch.randn(E, n, k, device="cuda", generator=g) * 0.02)
            dense = mxfp4.dequantize(blocks, scales, torch.float32) if c == 0 else None
            per.append((n, k, grouped.Mxfp4Weights.pack(blocks, scales), dense))
        weights.append(per)
    for tokens, pool in ((1, E), (4, E), (16, E), (16, 4)):
        gen = torch.Generator(device="cuda").manual_seed(100 + tokens + pool)
        x = torch.randn(tokens, H, device="cuda", generator=gen).to(dtype)
        logits = torch.randn(tokens, E, device="cuda", generator=gen)
        logits[:, pool:] = -1e4
        _, ids = moe.select_experts(logits.to(dtype), TOP_K, "topk_softmax")
        rows = ids.numel()
        cfg = grouped_gemm.default_config(rows, E, 2 * INTER, H, dtype=dtype)
        opts = {k: v for k, v in cfg.items() if k not in ("BLOCK_M", "LUT")}
        for gi, gemm in enumerate(("w13", "w2")):
            n, k = weights[0][gi][:2]
            a = x if gi == 0 else torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
            sort, plan = fused.align(ids, E, cfg["BLOCK_M"])
            gather = sort.token_index if gi == 0 else None
            src = a[gather] if gather is not None else a
            ref = torch.einsum("rk,rnk->rn", src.float(), weights[0][gi][3][sort.expert_of_row])
            cases = {key: (mod, plan, opts) for key, mod in kernels.items()}
            if "tm16" in variants:
                plan16 = fused.align(ids, E, 16)[1]
                cases["current_tm16"] = (kernels["current"], plan16, opts)
                if "nreg168" in variants:
                    cases["current_tm16_nreg168"] = (
                        kernels["current"], plan16, {**opts, "maxnreg": 168}
                    )  # fmt: skip
            errs, methods = {}, {}
            for key, (mod, p, o) in cases.items():
                lut = mod.lookup_table(torch.tensor(mxfp4.FP4_VALUES, device="cuda"), 4, dtype, 1.0)
                fns = [
                    functools.partial(
                        mod.grouped_lut_mma,
                        a,
                        per[gi][2].qweight,
                        per[gi][2].scales,
                        lut,
                        n,
                        p,
                        gather=gather,
                        ue8m0=True,
                        **o,
                    )  # fmt: skip
                    for per in weights
                ]
                errs[key] = rel_err(fns[0](), ref)
                methods[key] = fns
            floor_bytes = len(torch.unique(ids)) * (n * k // 2 + n * k // 32)
            times = timing.graph_times(list(methods.values()), max(floor_bytes / 4e6, 5.0))
            yield {
                "kind": "mxfp4", "gemm": gemm, "tokens": tokens, "pool": pool,
                "floor_us_at_4.8TBps": round(floor_bytes / 4.8e6, 2),
                "us": {key: round(t, 2) for key, t in zip(methods, times)}, "rel_err": errs,
            }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline", required=True, help="a copy of kbit/triton/mma.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="tm16,nreg168")
    args = ap.parse_args()
    torch.manual_seed(0)
    kernels = {"current": current, "baseline": load_module(args.baseline)}
    variants = [v for v in args.variants.split(",") if v]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    with open(args.out, "w") as f:
        for row in itertools.chain(mxfp4_rows(kernels, variants), kbit_rows(kernels, variants, l2)):
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
