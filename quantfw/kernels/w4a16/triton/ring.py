"""Gluon kernel for W4A16 at small M on Hopper: the ``mma.sync`` kernel of mma.py with
the weight words brought in by TMA through a shared-memory ring.

The small-M kernel loads each chunk's words into registers and waits for them before computing
the chunk, so a warp has one chunk in flight at a time.  Here one TMA copy per chunk brings the
CTA's ``W`` blocks x ``CH`` k16 steps of words (``W x CH x 512`` bytes, a box of the k-major
``[KB, NB, 128]`` view of ``qf``) into slot ``i % S`` of a ring, with an mbarrier per slot, so
``S - 1`` chunks are in flight while one is computed, at no register cost.  Each lane reads its
4 words of a step with one 16-byte shared load (a warp reads 512 contiguous bytes); the math
(``fold``: exact ``magic + q`` in the mma, scale and zero per group), the x and scale/zero
loads (from global memory, one chunk ahead in registers) and the split-K epilogue are those of
the small-M kernel.  Each CTA runs a contiguous range of chunks.

A tuning candidate for M <= 16 on Hopper (never a default; measurements in
benchmarks/w4a16-lab-log.md).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantfw.kernels.w4a16.triton.mma import (
    _chunk,
    _num_sms,
    _workspace,
    _zeros,
    as_int32_pairs,
    epilogue,
    fragment_tok_n,
    group_steps,
    lane_coords,
    load_chunk,
    split_plan,
)

plan = split_plan  # (split, n_iter) for a ring grid; each CTA runs a contiguous chunk range


@gluon.jit
def _issue(j, w_desc, w_smem, bars, nb0, kb_first, n_iter, CH: gl.constexpr, S: gl.constexpr):
    """TMA copy of chunk j (if the CTA has it) into slot j % S; past KB and NB it reads zeros."""
    sj = j % S
    ok = j < n_iter
    mbarrier.expect(bars.index(sj), w_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(
        w_desc, [kb_first + j * CH, nb0, 0], bars.index(sj), w_smem.index(sj), pred=ok
    )


@gluon.jit
def _words(w_view, s, CH: gl.constexpr, L3: gl.constexpr):
    """The CH word bundles of slot s: ``[W, 32, 4]`` each (warp, lane, word)."""
    wbs = ()
    for u in gl.static_range(CH):
        wbs = wbs + (w_view.index(s * CH + u).load(L3),)
    return wbs


@gluon.jit
def w4a16_ring_kernel(
    x_ptr,  # int32 view of x [M, K/2] (pairs of activations)
    w_desc,  # TMA descriptor of qf viewed [KB, NB, 128] int32 (k-major), block [CH, W, 128]
    sz_ptr,  # int32 [n_groups, N/64, 8, 8]
    bias_ptr,
    out_ptr,  # [M, N], x's dtype
    ws_ptr,  # fp32 split-K workspace (zeros)
    cnt_ptr,  # int32 arrival counters (zeros)
    M,
    N,
    K2,  # true input features / 2 (x pairs)
    NB,  # padded N / 64
    KB,  # padded K / 16
    n_iter,  # chunks per CTA
    stride_xm,  # in int32 units
    stride_om,
    W: gl.constexpr,  # warps per CTA, one 64-column block each
    CH: gl.constexpr,  # k16 steps per chunk
    GKB: gl.constexpr,  # k16 steps per quantization group
    TM: gl.constexpr,  # tokens per CTA tile: 8 or 16
    S: gl.constexpr,  # ring slots (chunks in flight + 1)
    SPLIT: gl.constexpr,
    MASK_N: gl.constexpr,  # NB is not a multiple of W
    MASK_K: gl.constexpr,  # the chunks overrun KB, or K is not a multiple of 16
    HAS_BIAS: gl.constexpr,
    IS_BF16: gl.constexpr,
):
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    XS: gl.constexpr = 2 if TM == 8 and CH % 2 == 0 else 1  # k16 steps per x bundle
    mt = gl.program_id(1)
    nb, l3, r3, g, c, x_off, x_k, sz_off, _ = lane_coords(M, stride_xm, W, W, TM, XS, L3)
    nb_ok = nb < NB
    nb0 = gl.program_id(0) * W
    kb_first = gl.program_id(2) * n_iter * CH

    w_smem = gl.allocate_shared_memory(gl.int32, [S, CH, W, 128], w_desc.layout)
    # the same bytes as [slot x step, block, lane, word] for the per-lane 16-byte reads
    w_view = w_smem._reinterpret(
        gl.int32, [S * CH, W, 32, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    )
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(S):
        mbarrier.init(bars.index(b), count=1)
    for b in gl.static_range(S - 1):
        _issue(b, w_desc, w_smem, bars, nb0, kb_first, n_iter, CH, S)

    accs = _zeros(4 * (TM // 8), W, L3)
    gaccs = _zeros(4 * (TM // 8), W, L3)  # per-group sums of (magic + q) x
    xsums = _zeros(TM // 8, W, L3)  # per-token sums of x
    _, xs, szs = load_chunk(
        x_ptr, x_ptr, sz_ptr, kb_first, 0, x_off, x_k, sz_off, nb_ok, KB, K2, NB,
        CH, GKB, XS, MASK_N, MASK_K, False,
    )  # fmt: skip
    for i in range(n_iter):
        # every warp has read slot (i - 1) % S (last iteration): refill it with chunk i + S - 1
        gl.thread_barrier()
        _issue(i + S - 1, w_desc, w_smem, bars, nb0, kb_first, n_iter, CH, S)
        # x and scale/zero of the next chunk, one chunk ahead (after the last chunk: the
        # first one again, unused, so that the loads need no extra masks)
        _, nxs, nszs = load_chunk(
            x_ptr, x_ptr, sz_ptr, kb_first + ((i + 1) % n_iter) * CH, 0, x_off, x_k, sz_off,
            nb_ok, KB, K2, NB, CH, GKB, XS, MASK_N, MASK_K, False,
        )  # fmt: skip
        s = i % S
        mbarrier.wait(bars.index(s), (i // S) & 1)
        wbs = _words(w_view, s, CH, L3)
        accs, gaccs, xsums = _chunk(
            wbs, xs, szs, accs, gaccs, xsums, W, L3, CH, GKB, XS, TM, True, IS_BF16
        )
        xs = nxs
        szs = nszs
    for b in gl.static_range(S):
        mbarrier.invalidate(bars.index(b))

    tok, n = fragment_tok_n(c, g, r3, nb)
    epilogue(
        accs, out_ptr, ws_ptr, cnt_ptr, bias_ptr, mt, tok, n, M, N, NB, stride_om,
        TM, SPLIT, HAS_BIAS,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# host side


def w4a16_ring_matmul(
    x2: torch.Tensor,
    qf: torch.Tensor,
    sz: torch.Tensor,
    N: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    warps: int = 4,
    chunk: int = 8,
    stages: int = 4,
    ctas_per_sm: int = 4,
) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W (+ bias) on sm_90; x2 fp16/bf16, K even.

    ``qf``/``sz``: pack_mma / pack_mma_scales tensors (padded to 16 x 64), ``sz`` in x's dtype.
    ``warps`` 64-column blocks per CTA, ``chunk`` k16 steps per TMA copy, ``stages`` ring
    slots, grid sized to about ``ctas_per_sm`` CTAs per SM."""
    M, K = x2.shape
    NB, KB = qf.shape[:2]
    if stages < 2:
        raise ValueError(f"w4a16 ring kernel: stages = {stages}; supported: 2 or more")
    x2 = as_int32_pairs(x2)
    gkb, chunk = group_steps(group_size, K, KB, chunk, "ring")
    tm = 8 if M <= 8 else 16
    mt = triton.cdiv(M, tm)
    nbt = triton.cdiv(NB, warps)
    split, n_iter = split_plan(triton.cdiv(KB, chunk), nbt * mt, _num_sms(x2.device), ctas_per_sm)
    # k-major view, so that one box holds the W blocks of each k16 step side by side
    w_desc = TensorDescriptor.from_tensor(
        qf.view(NB, KB, 128).permute(1, 0, 2),
        [chunk, warps, 128],
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3),
    )
    out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    ws, cnt = _workspace(x2.device, mt * tm * NB * 64 if split > 1 else 1, nbt * mt)
    has_bias = bias is not None
    w4a16_ring_kernel[(nbt, mt, split)](
        x2.view(torch.int32), w_desc, sz, bias if has_bias else out, out, ws, cnt,
        M, N, K // 2, NB, KB, n_iter, x2.stride(0) // 2, out.stride(0),
        W=warps, CH=chunk, GKB=gkb, TM=tm, S=stages, SPLIT=split,
        MASK_N=NB % warps != 0, MASK_K=split * n_iter * chunk != KB or K != KB * 16,
        HAS_BIAS=has_bias, IS_BF16=x2.dtype == torch.bfloat16, num_warps=warps,
    )  # fmt: skip
    return out
