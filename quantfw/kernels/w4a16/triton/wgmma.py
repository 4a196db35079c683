"""Gluon kernel for W4A16 on Hopper at larger M: dequantized weights as the register A operand
of ``wgmma``, x streamed by TMA.

Same packed layout as the ``mma.sync`` kernel (``pack_mma``; see mma.py): in block
``(nb, kb)`` lane ``l = 4g + c`` holds 4 words, word ``j`` being its ``m16n8k16`` A fragment for
the 16 columns ``64 nb + 16 j + (0..15)``.  A ``wgmma`` A tile is 64 rows (4 warps x 16), so
each warpgroup owns one 64-column block: its warp ``w`` takes word ``j = w`` and accumulator
row ``r`` is column ``64 nb + r``.  A CTA's ``NWG`` (1 or 2) warpgroups take adjacent blocks
and share the x tiles.  The computed product is ``W^T x^T`` (columns x tokens); the epilogue
transposes it in registers and stores rows of ``out``.

Per pipeline stage (``KS`` k16 steps): one TMA copy of the x tile ``[tokens, 16 KS]`` (zero
filled past M and K) and one of the blocks' ``KS x NWG x 512`` weight bytes land on an
mbarrier; each thread reads its ``KS`` words from shared memory, dequantizes them (``(q - z) *
s`` in the activation dtype, as the per-element path of the small-M kernel) into the A
fragment, and one asynchronous ``wgmma`` per stage adds ``A x^T`` while the next stage is
dequantized (into other registers: stages run in pairs, see ``_stage``).
Split-K CTAs meet in the same self-cleaning fp32 workspace buffer as the small-M kernel,
indexed row-major ``[M, NB * 64]`` so that adds and the last CTA's reads are 16-byte vectors.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantfw.kernels.w4a16.triton.mma import (
    _finish_tile,
    _num_sms,
    _workspace,
    deq_word_asm,
    group_steps,
    split_plan,
)

# pack = 8: inputs $4..$11 (the word, broadcast), $12..$19 (scale/zero pairs: t = 0 in
# $12..$15, t = 1 in $16..$19); outputs $0..$3 (8 halves, register p = element pair p)
_DEQ8_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 16))


@gluon.jit
def _a_step(words, szb, NW: gl.constexpr, IS_BF16: gl.constexpr):
    """One k16 step of the A tile ``[16 NW columns, 16]`` from a thread's word (``[NW, 32]``:
    warp, lane) and its scale/zero pairs (``[NW, 32, 8]``)."""
    asm: gl.constexpr = deq_word_asm(4, 12, 16, IS_BF16)
    wb, _ = gl.broadcast(gl.expand_dims(words, 2), szb)
    if IS_BF16:
        h = gl.inline_asm_elementwise(
            asm, _DEQ8_CONSTRAINTS, [wb, szb], dtype=gl.bfloat16, is_pure=True, pack=8
        )
    else:
        h = gl.inline_asm_elementwise(
            asm, _DEQ8_CONSTRAINTS, [wb, szb], dtype=gl.float16, is_pure=True, pack=8
        )
    # element e = 4x + 2y + h of lane 4g + c: column 16w + g + 8x, k = 8y + 2c + h
    h = gl.reshape(h, [NW, 8, 4, 2, 2, 2])
    h = gl.permute(h, [0, 3, 1, 4, 2, 5])
    return gl.reshape(h, [16 * NW, 16])


@gluon.jit
def _words(w_view, idx, NW: gl.constexpr, WL: gl.constexpr, L8: gl.constexpr):
    """Word ``w % 4`` of block ``w // 4`` for warp ``w``, every lane: ``[NW, 32]``."""
    words = w_view.index(idx).permute((0, 2, 1)).load(WL)  # [block, word, lane]
    return gl.convert_layout(gl.reshape(words, [NW, 32]), gl.SliceLayout(2, L8))


@gluon.jit
def _a_stage(
    w_view, szs, base, NW: gl.constexpr, WL: gl.constexpr, L8: gl.constexpr,
    KS: gl.constexpr, IS_BF16: gl.constexpr,
):  # fmt: skip
    """The A tile ``[16 NW, 16 KS]`` of one stage: its KS steps put side by side along k."""
    R: gl.constexpr = 16 * NW
    a0 = _a_step(_words(w_view, base, NW, WL, L8), szs[0], NW, IS_BF16)
    if KS == 1:
        a = a0
    else:
        a1 = _a_step(_words(w_view, base + 1, NW, WL, L8), szs[1], NW, IS_BF16)
        if KS == 2:
            a = gl.reshape(gl.permute(gl.join(a0, a1), [0, 2, 1]), [R, 32])
        else:
            a2 = _a_step(_words(w_view, base + 2, NW, WL, L8), szs[2], NW, IS_BF16)
            a3 = _a_step(_words(w_view, base + 3, NW, WL, L8), szs[3], NW, IS_BF16)
            # [R, 16, u % 2, u // 2] -> [R, u // 2, u % 2, 16]
            a = gl.join(gl.join(a0, a1), gl.join(a2, a3))
            a = gl.reshape(gl.permute(a, [0, 3, 2, 1]), [R, 64])
    return a


@gluon.jit
def _sz_stage(sz_ptr, sz_off, kb0, n_groups, NB, KS: gl.constexpr, GKB: gl.constexpr):
    """Scale/zero pairs for each k16 step of a stage (a tuple of KS, shared within a group)."""
    res = ()
    for u in gl.static_range(KS):
        if u == 0 or u % GKB == 0:
            grp = gl.minimum((kb0 + u) // GKB, n_groups - 1)
            cur = gl.load(sz_ptr + grp * (NB * 64) + sz_off)
        res = res + (cur,)
    return res


@gluon.jit
def _stage(
    i, acc, x_desc, w_desc, x_smem, w_smem, w_view, bars, sz_ptr, sz_off, st0, n_iter, n_groups,
    NB, nb0, m0, NW: gl.constexpr, WL: gl.constexpr, L8: gl.constexpr, A_L: gl.constexpr,
    KS: gl.constexpr, S: gl.constexpr, GKB: gl.constexpr, NBYTES: gl.constexpr,
    IS_BF16: gl.constexpr,
):  # fmt: skip
    """Stage i: dequantize its A, start its wgmma, retire stage i - 1's and refill that slot
    with stage i + S - 1."""
    s = i % S
    szs = _sz_stage(sz_ptr, sz_off, (st0 + i) * KS, n_groups, NB, KS, GKB)
    mbarrier.wait(bars.index(s), (i // S) & 1)
    a = gl.convert_layout(_a_stage(w_view, szs, s * KS, NW, WL, L8, KS, IS_BF16), A_L)
    acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(1, deps=(acc,))
    # stage i - 1 is no longer read (its wgmma has retired, its words are in registers in
    # every warp)
    gl.thread_barrier()
    _load_stage(
        i + S - 1, x_desc, w_desc, x_smem, w_smem, bars, st0, n_iter, nb0, m0, KS, S, NBYTES
    )
    return acc


@gluon.jit
def _load_stage(
    j, x_desc, w_desc, x_smem, w_smem, bars, st0, n_iter, nb0, m0, KS: gl.constexpr,
    S: gl.constexpr, NBYTES: gl.constexpr,
):  # fmt: skip
    """TMA copies of stage j (if it exists) into slot j % S: x tile and the weight words."""
    sj = j % S
    ok = j < n_iter
    mbarrier.expect(bars.index(sj), NBYTES, pred=ok)
    tma.async_copy_global_to_shared(
        x_desc, [m0, (st0 + j) * 16 * KS], bars.index(sj), x_smem.index(sj), pred=ok
    )
    tma.async_copy_global_to_shared(
        w_desc, [(st0 + j) * KS, nb0, 0], bars.index(sj), w_smem.index(sj), pred=ok
    )


@gluon.jit
def w4a16_wgmma_kernel(
    x_desc,  # TMA descriptor of x [M, K], block [BT, 16 * KS]
    w_desc,  # TMA descriptor of qf viewed [KB, NB, 128] int32, block [KS, NWG, 128]
    sz_ptr,  # int32 [n_groups, NB, 8, 8]
    bias_ptr,
    out_ptr,  # [M, N], x's dtype
    ws_ptr,  # fp32 split-K workspace (zeros)
    cnt_ptr,  # int32 arrival counters (zeros)
    M,
    N,
    NB,
    n_groups,
    n_iter,  # stages per CTA (even when PAIRS)
    stride_om,
    BT: gl.constexpr,  # tokens per CTA
    NWG: gl.constexpr,  # warpgroups per CTA, one 64-column block each (they share x)
    KS: gl.constexpr,  # k16 steps per stage
    S: gl.constexpr,  # pipeline stages
    GKB: gl.constexpr,  # k16 steps per quantization group
    SPLIT: gl.constexpr,
    PAIRS: gl.constexpr,  # n_iter > 1 (and even); else n_iter == 1
    MASK_N: gl.constexpr,  # N is not a multiple of 64 NWG
    HAS_BIAS: gl.constexpr,
    IS_BF16: gl.constexpr,
):
    NW: gl.constexpr = 4 * NWG
    BK: gl.constexpr = 16 * KS
    mt = gl.program_id(0)
    nb0 = gl.program_id(1) * NWG
    sp = gl.program_id(2)
    m0 = mt * BT

    # [warp, lane, 8 halves]: warp w dequantizes word w % 4 of block nb0 + w // 4
    L8: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
    WL: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 1, 32], [NWG, 4, 1], [2, 1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 16]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [S, BT, BK], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [S, KS, NWG, 128], w_desc.layout)
    # the same bytes as [S * KS, block, lane, word] for the per-thread reads (no swizzle)
    w_view = w_smem._reinterpret(
        gl.int32, [S * KS, NWG, 32, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    )
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(S):
        mbarrier.init(bars.index(b), count=1)
    NBYTES: gl.constexpr = BT * BK * 2 + KS * NWG * 512

    # scale/zero of the thread's columns: [grp, block, g, 2 (w % 4) + t], t = e // 4
    w_i = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, L8)))
    l_i = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L8)))
    e_i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L8)))
    w3 = gl.expand_dims(gl.expand_dims(w_i, 1), 2)
    l3 = gl.expand_dims(gl.expand_dims(l_i, 0), 2)
    e3 = gl.expand_dims(gl.expand_dims(e_i, 0), 1)
    blk = gl.minimum(nb0 + w3 // 4, NB - 1)  # blocks past NB (zero weights) are never stored
    sz_off = blk * 64 + (l3 // 4) * 8 + 2 * (w3 % 4) + e3 // 4

    st0 = sp * n_iter  # first stage of this CTA
    for b in gl.static_range(S - 1):
        _load_stage(b, x_desc, w_desc, x_smem, w_smem, bars, st0, n_iter, nb0, m0, KS, S, NBYTES)

    acc = gl.zeros([16 * NW, BT], gl.float32, MMA)
    # A's registers are read by a wgmma until the wait that retires it, so consecutive stages
    # must dequantize into different registers: stages go in pairs (two SSA values, two PTX
    # register sets; a plain loop rewrites the in-flight A: seen as wrong sums on H200)
    if PAIRS:
        gl.assume(n_iter > 1)
        for i in range(0, n_iter, 2):
            acc = _stage(
                i, acc, x_desc, w_desc, x_smem, w_smem, w_view, bars, sz_ptr, sz_off, st0,
                n_iter, n_groups, NB, nb0, m0, NW, WL, L8, A_L, KS, S, GKB, NBYTES, IS_BF16,
            )  # fmt: skip
            acc = _stage(
                i + 1, acc, x_desc, w_desc, x_smem, w_smem, w_view, bars, sz_ptr, sz_off, st0,
                n_iter, n_groups, NB, nb0, m0, NW, WL, L8, A_L, KS, S, GKB, NBYTES, IS_BF16,
            )  # fmt: skip
    else:
        acc = _stage(
            0, acc, x_desc, w_desc, x_smem, w_smem, w_view, bars, sz_ptr, sz_off, st0,
            n_iter, n_groups, NB, nb0, m0, NW, WL, L8, A_L, KS, S, GKB, NBYTES, IS_BF16,
        )  # fmt: skip
    acc = warpgroup_mma_wait(0, deps=(acc,))
    for b in gl.static_range(S):
        mbarrier.invalidate(bars.index(b))

    # tokens x columns, 8 consecutive columns per thread
    OL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    v = gl.convert_layout(gl.permute(acc, (1, 0)), OL)
    m = m0 + gl.expand_dims(gl.arange(0, BT, layout=gl.SliceLayout(1, OL)), 1)
    n = nb0 * 64 + gl.expand_dims(gl.arange(0, 16 * NW, layout=gl.SliceLayout(0, OL)), 0)
    # workspace [M, NB * 64], row-major: a thread's 8 columns are adjacent (the small-M
    # kernels' [columns, tokens] tiles would make every add of a warp touch its own sector)
    wsi = m * (NB * 64) + n
    mask = m < M
    if SPLIT > 1:
        _finish_tile(
            v, out_ptr, ws_ptr, bias_ptr, m, n, wsi, mask, N, stride_om,
            SPLIT, HAS_BIAS, False, MASK_N,
        )  # fmt: skip
        gl.thread_barrier()
        cnt = cnt_ptr + gl.program_id(1) * gl.num_programs(0) + mt
        ticket = gl.atomic_add(cnt, 1, sem="acq_rel")
        if ticket == SPLIT - 1:
            gl.atomic_xchg(cnt, 0, sem="relaxed")
            _finish_tile(
                v, out_ptr, ws_ptr, bias_ptr, m, n, wsi, mask, N, stride_om,
                SPLIT, HAS_BIAS, True, MASK_N, SWAP=False,
            )  # fmt: skip
    else:
        _finish_tile(
            v, out_ptr, ws_ptr, bias_ptr, m, n, wsi, mask, N, stride_om,
            SPLIT, HAS_BIAS, True, MASK_N,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# host side


def _plan(stages: int, tiles: int, sms: int, ctas_per_sm: int) -> tuple[int, int]:
    """(split, n_iter); n_iter even when above 1: the kernel runs stages in pairs."""
    return split_plan(stages, tiles, sms, ctas_per_sm, even=True)


def w4a16_wgmma_matmul(
    x2: torch.Tensor,
    qf: torch.Tensor,
    sz: torch.Tensor,
    N: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    bt: int = 64,
    nwg: int = 1,
    ks: int = 4,
    stages: int = 4,
    ctas_per_sm: int = 2,
) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W (+ bias) on sm_90; x2 fp16/bf16.

    ``qf``/``sz``: pack_mma / pack_mma_scales tensors (padded to 16 x 64), ``sz`` in x's dtype.
    ``bt`` tokens per CTA (8..256, a multiple of 8), ``nwg`` warpgroups per CTA (one 64-column
    block each, sharing the x tiles), ``ks`` k16 steps per pipeline stage, ``stages`` stages
    in flight."""
    M, K = x2.shape
    NB, KB = qf.shape[:2]
    if nwg not in (1, 2):  # 4 (16 warps) is correct but slower on H200
        raise ValueError(f"w4a16 wgmma kernel: nwg = {nwg}; supported: 1, 2")
    if ks not in (1, 2, 4):  # _a_stage assembles A from at most 4 k16 steps
        raise ValueError(f"w4a16 wgmma kernel: ks = {ks}; supported: 1, 2, 4")
    if bt % 8 or not 8 <= bt <= 256:
        raise ValueError(f"w4a16 wgmma kernel: bt = {bt}; supported: multiples of 8 in 8..256")
    if K % 8:  # TMA rows must be 16-byte aligned; the packed weights past K are zero rows
        x2 = torch.nn.functional.pad(x2, (0, 8 - K % 8))
    elif x2.stride(1) != 1 or x2.stride(0) != K or x2.data_ptr() % 16:
        x2 = x2.contiguous() if x2.data_ptr() % 16 == 0 else x2.clone()
    gkb, ks = group_steps(group_size, K, KB, ks, "wgmma")
    gdt = gl.bfloat16 if x2.dtype == torch.bfloat16 else gl.float16
    x_desc = TensorDescriptor.from_tensor(
        x2, [bt, 16 * ks], gl.NVMMASharedLayout.get_default_for([bt, 16 * ks], gdt)
    )
    # k-major view, so that one box holds the nwg blocks of each k16 step side by side
    w_desc = TensorDescriptor.from_tensor(
        qf.view(NB, KB, 128).permute(1, 0, 2),
        [ks, nwg, 128],
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3),
    )
    mt = triton.cdiv(M, bt)
    nbt = triton.cdiv(NB, nwg)
    split, n_iter = _plan(triton.cdiv(KB, ks), mt * nbt, _num_sms(x2.device), ctas_per_sm)
    out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    ws, cnt = _workspace(x2.device, mt * bt * NB * 64 if split > 1 else 1, nbt * mt)
    has_bias = bias is not None
    w4a16_wgmma_kernel[(mt, nbt, split)](
        x_desc, w_desc, sz, bias if has_bias else out, out, ws, cnt,
        M, N, NB, sz.shape[0], n_iter, out.stride(0),
        BT=bt, NWG=nwg, KS=ks, S=stages, GKB=gkb, SPLIT=split, PAIRS=n_iter > 1,
        MASK_N=N % (64 * nwg) != 0,
        HAS_BIAS=has_bias, IS_BF16=x2.dtype == torch.bfloat16, num_warps=4 * nwg,
    )  # fmt: skip
    return out
