"""Triton kernels over the tiled kbit layout (``quantfw/kernels/kbit/layout.py``), in plain
``triton.language`` (they also run in Triton's CPU interpreter, ``TRITON_INTERPRET=1``).

* ``kbit_repack_kernel``: flat ``planes [N, K/32, bits]`` / ``absmax [N, K/32]`` -> the tiled
  ``qweight [KT, NT, 128, 2, bits]`` / ``scales [KT, NT, 128, 2]``, one (k tile, n tile) per
  program, padding with zero blocks.
* ``kbit_dequant_kernel``: the tiled weight -> a dense ``[N, K]`` weight in the activation
  dtype (the large-M path: dequantize, then cuBLAS through ``F.linear``).
* ``kbit_gemm_kernel``: ``out [M, N] = x [M, K] @ W.T`` (+ bias) with the weight dequantized
  tile by tile in registers (``dequant_tile``): each bit-plane word is loaded once per (block,
  column); the tile is built lane by lane (element ``l`` of every block at once), so shifts
  and masks are constants; K <= 3 picks the level with a tree of selects on the lane's bits,
  K >= 4 assembles the index and gathers the level from the codebook (L1 resident); the E4M4
  scale of the (block, column) is decoded with integer ops and applied, and ``tl.dot`` runs
  the tile on tensor cores with fp32 accumulation. Small M uses a 16-row token tile; split-K
  CTAs add into a shared fp32 workspace and the last CTA of an output tile to arrive (an
  acq_rel ticket) reads the sums and writes zeros back, adds the bias and stores: one launch
  per matmul, no host synchronization (CUDA-graph capturable).
"""

from __future__ import annotations

import triton
import triton.language as tl

TILE_N = tl.constexpr(128)  # layout.TILE_N
TILE_K = tl.constexpr(64)  # layout.TILE_K: two blocks of 32


@triton.jit
def kbit_repack_kernel(
    planes_ptr,  # int32 [N, KB, BITS]
    absmax_ptr,  # uint8 [N, KB]
    qweight_ptr,  # out: int32 [KT, NT, TILE_N, 2, BITS]
    scales_ptr,  # out: uint8 [KT, NT, TILE_N, 2]
    N,
    KB,
    NT,
    BITS: tl.constexpr,
):
    kt = tl.program_id(0)
    nt = tl.program_id(1)
    c = tl.arange(0, TILE_N)[:, None]
    j = tl.arange(0, 2)[None, :]
    n = nt * TILE_N + c
    kb = kt * 2 + j
    mask = (n < N) & (kb < KB)
    tile = (kt * NT + nt) * TILE_N + c
    for b in tl.static_range(BITS):
        word = tl.load(planes_ptr + (n * KB + kb) * BITS + b, mask=mask, other=0)
        tl.store(qweight_ptr + (tile * 2 + j) * BITS + b, word)
    code = tl.load(absmax_ptr + n * KB + kb, mask=mask, other=0)
    tl.store(scales_ptr + tile * 2 + j, code)


@triton.jit
def decode_e4m4(code):
    """uint8 E4M4 codes -> float32 (bias 11; exponent field 0: subnormal M * 2**-14)."""
    c = code.to(tl.int32)
    e = c >> 4
    m = c & 0xF
    normal = (((e + 116) << 23) | (m << 19)).to(tl.float32, bitcast=True)
    return tl.where(e > 0, normal, m.to(tl.float32) * 0.00006103515625)


@triton.jit
def _lane_index(words, lane: tl.constexpr, BITS: tl.constexpr):
    """The index of element ``lane`` of each block: bit ``lane`` of plane ``b`` moved to bit ``b``
    (constant shifts: one shift and one and-or per bit)."""
    idx = tl.zeros_like(words[0])
    for b in tl.static_range(BITS):
        if lane >= b:
            idx |= (words[b] >> (lane - b)) & (1 << b)
        else:
            idx |= (words[b] << (b - lane)) & (1 << b)
    return idx


@triton.jit
def _lane_bit(word, lane: tl.constexpr):
    """Whether bit ``lane`` of each int32 word is set."""
    if lane == 31:
        return word < 0
    else:
        return (word & (1 << lane)) != 0


@triton.jit
def _lane_level(words, levels, codebook_ptr, lane: tl.constexpr, BITS: tl.constexpr):
    """The codebook level of element ``lane`` of each block. K <= 3: a tree of selects between
    the levels (scalars), one per index bit; K >= 4: a gather from the codebook (L1 resident)
    at the index assembled from the planes."""
    if BITS <= 3:
        vals = levels
        for b in tl.static_range(BITS):  # pairs (2i, 2i + 1) differ in bit b of the index
            bit = _lane_bit(words[b], lane)
            nxt = ()
            for i in tl.static_range((1 << BITS) >> (b + 1)):
                nxt = nxt + (tl.where(bit, vals[2 * i + 1], vals[2 * i]),)
            vals = nxt
        return vals[0]
    else:
        return tl.load(codebook_ptr + _lane_index(words, lane, BITS))


@triton.jit
def dequant_tile(
    qweight_ptr, scales_ptr, codebook_ptr, n, kt0, KT, NT,
    BITS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """float32 ``[BLOCK_K, len(n)]`` (k-major: the B operand of ``tl.dot``): columns ``n`` (one
    n tile's worth or less) of the weight at k = ``kt0 * 64 .. + BLOCK_K``; k tiles at or past
    KT read as zeros."""
    BKB: tl.constexpr = BLOCK_K // 32
    kb = kt0 * 2 + tl.arange(0, BKB)  # blocks of this k range
    kt = kb // 2
    tile = (kt[:, None] * NT + (n // TILE_N)[None, :]) * TILE_N + (n % TILE_N)[None, :]
    block = tile * 2 + (kb % 2)[:, None]  # [BKB, BN]: (block, column) index in the layout
    ok = (kt < KT)[:, None]
    scale = decode_e4m4(tl.load(scales_ptr + block, mask=ok, other=0))
    words = ()
    for b in tl.static_range(BITS):
        words = words + (tl.load(qweight_ptr + block * BITS + b, mask=ok, other=0),)
    # one [BKB, BN] tensor per lane, each with constant shifts; joined pairwise so that the
    # trailing dims (j0, .., j4) hold lane j0 + 2 j1 + 4 j2 + 8 j3 + 16 j4
    levels = ()
    if BITS <= 3:
        for j in tl.static_range(1 << BITS):
            levels = levels + (tl.load(codebook_ptr + j),)
    vals = ()
    for lane in tl.static_range(32):
        vals = vals + (_lane_level(words, levels, codebook_ptr, lane, BITS) * scale,)
    for level in tl.static_range(5):
        joined = ()
        for i in tl.static_range(16 >> level):
            joined = joined + (tl.join(vals[2 * i], vals[2 * i + 1]),)
        vals = joined
    values = tl.permute(vals[0], (0, 6, 5, 4, 3, 2, 1))  # [BKB, j4, j3, j2, j1, j0, BN]
    return tl.reshape(values, [BLOCK_K, n.shape[0]])  # k = 32 * block + lane


@triton.jit
def kbit_dequant_kernel(
    qweight_ptr, scales_ptr, codebook_ptr, w_ptr, N, K, KT, NT,
    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``w [N, K]`` (activation dtype) from the tiled weight; grid (N / BLOCK_N, K / BLOCK_K)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kt0 = tl.program_id(1) * (BLOCK_K // TILE_K)
    w = dequant_tile(qweight_ptr, scales_ptr, codebook_ptr, n, kt0, KT, NT, BITS, BLOCK_K)
    w = tl.trans(w)  # [BLOCK_N, BLOCK_K]: rows of w_ptr
    k = kt0 * TILE_K + tl.arange(0, BLOCK_K)
    mask = (n < N)[:, None] & (k < K)[None, :]
    rows = n.to(tl.int64)[:, None] * K  # N * K may pass 2**31
    tl.store(w_ptr + rows + k[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def kbit_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, codebook_ptr, out_ptr, bias_ptr, ws_ptr, cnt_ptr,
    M, N, K, KT, NT, stride_xm, stride_om, ITERS, SPLIT,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """grid (N / BLOCK_N, SPLIT, M / BLOCK_M); CTA ``s`` of an output tile runs the ``ITERS``
    k steps (of BLOCK_K) from ``s * ITERS``. BLOCK_N divides 128, BLOCK_K is a multiple of 64."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = (m < M)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(ITERS):
        kt0 = (pid_s * ITERS + it) * (BLOCK_K // TILE_K)
        k = kt0 * TILE_K + tl.arange(0, BLOCK_K)
        x_mask = m_ok & (k < K)[None, :]
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w = dequant_tile(qweight_ptr, scales_ptr, codebook_ptr, n, kt0, KT, NT, BITS, BLOCK_K)
        acc = tl.dot(x, w.to(x.dtype), acc)
    mask = m_ok & (n < N)[None, :]
    offs = m[:, None] * N + n[None, :]
    if SPLIT > 1:
        tl.atomic_add(ws_ptr + offs, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()
        cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(cnt, 1, sem="acq_rel")
        if ticket == SPLIT - 1:
            tl.atomic_xchg(cnt, 0, sem="relaxed")
            # after the acquiring ticket every CTA's adds have landed in L2: read them past L1
            acc = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(ws_ptr + offs, tl.zeros_like(acc), mask=mask)
            _store(acc, out_ptr, bias_ptr, m, n, mask, N, stride_om, HAS_BIAS)
    else:
        _store(acc, out_ptr, bias_ptr, m, n, mask, N, stride_om, HAS_BIAS)


@triton.jit
def _store(acc, out_ptr, bias_ptr, m, n, mask, N, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
