"""Run with TRITON_INTERPRET=1 (CPU): the grouped expert GEMM (MXFP4 and dense weights), the
whole MoE pipeline and the dense MXFP4 linear against the references, at small sizes; the
in-kernel MXFP4 decode bit for bit against `mxfp4.dequantize` for every byte and scale. Prints
one line per check and exits non-zero on a failure."""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl
from script_checks import FAILED, check, patch_interpreter_scalar_index, rel

from quantfw.kernels import moe, mxfp4
from quantfw.kernels.fused import reference as fused_ref
from quantfw.kernels.mxfp4 import grouped
from quantfw.kernels.mxfp4.triton import grouped_gemm as gg


@triton.jit
def _decode_kernel(packed_ptr, scale_ptr, out_ptr, N: tl.constexpr):
    """Decode N bytes (low then high nibble) under one scale byte per row."""
    row = tl.program_id(0)
    j = tl.arange(0, N)
    p = tl.load(packed_ptr + row * N + j).to(tl.int32)
    s = tl.load(scale_ptr + row).to(tl.int32)
    f = gg._ue8m0_half(s)
    tl.store(out_ptr + row * 2 * N + 2 * j, gg._e2m1_times_two(p & 15) * f)
    tl.store(out_ptr + row * 2 * N + 2 * j + 1, gg._e2m1_times_two(p >> 4) * f)


def dequantize() -> None:
    from quantfw.kernels.mxfp4.triton.dequantize import dequantize as deq_kernel

    g = torch.Generator().manual_seed(3)
    for n, k in ((24, 96), (70, 256), (64, 416)):  # K short of a quad, whole quads; N padded
        blocks, scales = mxfp4.quantize(torch.randn(2, n, k, generator=g))
        scales[0, 0, 0], scales[1, -1, -1] = 1, 140
        got = deq_kernel(grouped.Mxfp4Weights.pack(blocks, scales), torch.float32)
        same = torch.equal(got, mxfp4.dequantize(blocks, scales, torch.float32))
        check(f"expert dequantize kernel N={n} K={k}, bitwise", 0.0 if same else 1.0, 0.0)


def input_order() -> None:
    """The wgmma kernel's activation copy (gather + each block's 4 x 4 transpose of pairs)
    against the torch permutation."""
    from quantfw.kernels.mxfp4.triton import wgmma

    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 352, generator=g).to(torch.bfloat16)  # 11 blocks: a partial program
    rows = torch.tensor([8, 0, 3, 3, 5])
    for idx in (None, rows):
        same = torch.equal(wgmma._input_order_triton(x, idx), wgmma.input_order(x, idx))
        check(f"wgmma input order, gather={idx is not None}", 0.0 if same else 1.0, 0.0)


def decode() -> None:
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # every byte, every scale
    scales = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256, 512, dtype=torch.float32)
    _decode_kernel[(256,)](packed, scales, out, N=256)
    ref = mxfp4.dequantize(
        packed.view(256, 16, 16), scales.view(256, 1).expand(256, 16).contiguous(), torch.float32
    )
    same = torch.equal(out.view(torch.int32), ref.view(torch.int32))
    check("in-kernel decode, every byte x every scale, bitwise", 0.0 if same else 1.0, 0.0)


def experts(e, n, k, g, quantized):
    w = torch.randn(e, n, k, generator=g) * 0.3
    if not quantized:
        return grouped.DenseWeights(w), w
    blocks, scales = mxfp4.quantize(w)
    scales[0, 0, 0] = 1  # tiny and huge blocks next to ordinary ones
    scales[-1, 1, -1] = 134
    return grouped.Mxfp4Weights.pack(blocks, scales), mxfp4.dequantize(
        blocks, scales, torch.float32
    )


def grouped_gemm() -> None:
    g = torch.Generator().manual_seed(0)
    e, n, k, t, top = 4, 40, 160, 9, 2  # K: one whole quad and part of the next
    for quantized in (True, False):
        for cfg in (
            dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=1),
            dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=1, SWAP=True),
        ):
            w, dense = experts(e, n, k, g, quantized)
            x = torch.randn(t, k, generator=g)
            ids = torch.randint(0, e - 1, (t, top), generator=g)  # expert e-1 gets no rows
            ids[0] = torch.tensor([2, 0])
            bias = torch.randn(e, n, generator=g)
            sort = moe.sort_by_expert(ids, e)
            plan = moe.block_schedule(sort.m_indptr, t * top, cfg["BLOCK_M"])
            out = gg.grouped_gemm(x, w, plan, bias=bias, gather=sort.token_index, config=cfg)
            ref = torch.stack(
                [x[tok].double() @ dense[ex].double().T + bias[ex].double()
                 for tok, ex in zip(sort.token_index.tolist(), sort.expert_of_row.tolist())]
            )  # fmt: skip
            tag = f"{'mxfp4' if quantized else 'dense'} BN={cfg['BLOCK_N']} BK={cfg['BLOCK_K']}"
            tag += " swap" if cfg.get("SWAP") else ""
            check(f"grouped_gemm {tag}", rel(out, ref), 1e-5)


def pipeline() -> None:
    g = torch.Generator().manual_seed(1)
    e, h, i, t, top = 5, 64, 96, 7, 2
    w13, d13 = experts(e, 2 * i, h, g, True)
    w2, d2 = experts(e, h, i, g, True)
    b13, b2 = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    x = torch.randn(t, h, generator=g)
    weights, ids = moe.select_experts(torch.randn(t, e, generator=g), top, "topk_softmax")
    act = lambda y: fused_ref.swiglu_oai(y, 1.702, 7.0)  # noqa: E731
    ref = moe.experts_forward_cpu(
        x.double(), weights.double(), ids, num_experts=e,
        expert_weights=lambda ex: (d13[ex].double(), d2[ex].double()),
        activation=act, w13_bias=b13.double(), w2_bias=b2.double(),
    )  # fmt: skip
    for name, cfg in (
        ("mma", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=1, SWAP=True)),
        ("dequant", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1,
                         DEQUANT=True)),
    ):  # fmt: skip
        out = grouped.moe_forward(
            x, weights, ids, w13=w13, w2=w2, w13_bias=b13, w2_bias=b2, activation=act, config=cfg
        )
        check(f"moe_forward mxfp4 {name} (swiglu, biases)", rel(out, ref), 1e-5)
    wl, dl = experts(1, 48, 64, g, True)
    xl, bl = torch.randn(3, 5, 64, generator=g), torch.randn(48, generator=g)
    lin = grouped.linear(xl, grouped.Mxfp4Weights(wl.qweight[0], wl.scales[0], wl.n, wl.k), bl)
    check("dense mxfp4 linear", rel(lin, xl.double() @ dl[0].double().T + bl.double()), 1e-5)
    from quantfw.kernels.fused import triton_ops

    y = torch.randn(6, 2 * 80, generator=g) * 6  # beyond the clamp limit too
    for limit in (7.0, None):
        ref = fused_ref.swiglu_oai(y, 1.702, limit)
        check(f"swiglu_oai limit={limit}", rel(triton_ops.swiglu_oai(y, 1.702, limit), ref), 1e-6)


def align() -> None:
    from quantfw.kernels.mxfp4.triton import sort as fused

    g = torch.Generator().manual_seed(2)
    cases = ((1, 4, 32, 16), (9, 2, 6, 16), (40, 4, 32, 16), (33, 2, 8, 4))
    # sort_and_plan: one chunk, several (the last partial), experts past a power of two
    chunked = ((40, 4, 32, 16), (300, 4, 32, 64), (700, 2, 5, 256), (1100, 8, 128, 64))
    runs = [(fused.align, c) for c in cases] + [(fused.sort_and_plan, c) for c in chunked]
    for fn, (t, top, e, bm) in runs:
        ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(t)])
        ids[0, 0] = e - 1
        sort, plan = fn(ids, e, bm)
        ref = moe.sort_by_expert(ids, e)
        ref_plan = moe.block_schedule(ref.m_indptr, t * top, bm, top)
        same = all(
            torch.equal(getattr(sort, f), getattr(ref, f))
            for f in ("token_index", "expert_of_row", "inverse", "m_indptr")
        ) and torch.equal(plan.block_expert, ref_plan.block_expert)
        same = same and plan.min_blocks == ref_plan.min_blocks > 0
        real = ref_plan.block_expert < e
        same = same and torch.equal(plan.block_row[real], ref_plan.block_row[real])
        check(f"{fn.__name__} t={t} k={top} E={e} block_m={bm}", 0.0 if same else 1.0, 0.0)
        rows = torch.randn(t * top, 48, generator=g)
        w = torch.rand(t, top, generator=g)
        check(
            f"combine t={t} k={top}",
            rel(fused.combine(rows, sort, w), moe.combine(rows, ref, w)),
            1e-6,
        )


def _torch_route(logits, top, scoring, renorm):
    """`moe.select_experts`'s torch arithmetic (what transformers' routers compute)."""
    if scoring == "softmax_topk":
        w, ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), top, dim=-1)
        w = w / w.sum(-1, keepdim=True) if renorm else w
        return w.to(logits.dtype), ids
    v, ids = torch.topk(logits, top, dim=-1)
    w = torch.softmax(v, -1, dtype=v.dtype)
    return (w / w.sum(-1, keepdim=True) if renorm else w), ids


def router() -> None:
    from quantfw.kernels.moe.triton_routing import router_topk

    g = torch.Generator().manual_seed(4)
    cases = ((1, 32, 4), (19, 8, 3), (40, 128, 8), (5, 60, 6), (3, 7, 7))
    # float16, not bfloat16: Triton 3.6's interpreter truncates float32 -> bfloat16 (the GPU
    # rounds to nearest; the gpu test covers bfloat16)
    for (t, e, top), dtype in itertools.product(cases, (torch.float32, torch.float16)):
        for scoring, renorm in itertools.product(moe.SCORING_FUNCTIONS, (False, True)):
            # distinct logits in every dtype (no ties), read through a row stride
            distinct = torch.stack([torch.randperm(e + 3, generator=g) for _ in range(t)])
            logits = ((distinct - e / 2) / 8).to(dtype)[:, 1 : e + 1]
            w, ids = router_topk(logits, top, scoring == "softmax_topk", renorm)
            ref_w, ref_ids = _torch_route(logits, top, scoring, renorm)
            # elementwise relative error; float16: one unit in the last place (the kernel's exp
            # and torch's can differ by a float32 ulp, which may round the other way)
            err = ((w.double() - ref_w.double()).abs() / ref_w.double().abs()).max().item()
            err = err if torch.equal(ids, ref_ids) else 1.0
            tol = 1e-6 if dtype == torch.float32 else 2**-10
            check(f"router t={t} E={e} k={top} {scoring} renorm={renorm} {dtype}", err, tol)
    tied = torch.zeros(2, 8)  # equal logits: the lower expert ids, in order
    tied[1, 5] = 1.0
    _, ids = router_topk(tied, 3, False, False)
    check("router ties -> lower ids", 0.0 if ids.tolist() == [[0, 1, 2], [5, 0, 1]] else 1.0, 0.0)
    # fewer than k finite logits, NaN (ranked highest, as torch.topk does), E not a power of
    # two: k distinct real experts, the finite ones in torch's order, zero weight for -inf
    inf, nan = float("inf"), float("nan")
    odd = torch.tensor([[1.0, -inf, -inf, -inf, 0.5, -inf], [nan] * 6, [0.0, nan, 2.0, 1.0, -1, 3]])
    for scoring in moe.SCORING_FUNCTIONS:
        w, ids = router_topk(odd, 3, scoring == "softmax_topk", False)
        distinct = all(len(set(r)) == 3 and max(r) < 6 for r in ids.tolist())
        ok = distinct and ids[0, :2].tolist() == [0, 4] and w[0, 2].item() == 0.0
        ok = ok and ids[2, 0].item() == 1 and ids[2, 1:].tolist() == [5, 2]
        check(f"router -inf / NaN logits {scoring}: distinct real ids", 0.0 if ok else 1.0, 0.0)


if __name__ == "__main__":
    patch_interpreter_scalar_index()
    router()
    align()
    decode()
    input_order()
    dequantize()
    grouped_gemm()
    pipeline()
    sys.exit(1 if FAILED else 0)
