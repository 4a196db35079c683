"""Triton kernels over the field-packed kbit layout (``quantfw/kernels/kbit/layout.py``), in
plain ``triton.language`` (they also run in Triton's CPU interpreter, ``TRITON_INTERPRET=1``).

* ``kbit_repack_kernel``: flat ``planes [N, K/32, bits]`` / ``absmax [N, K/32]`` ->
  ``qweight [N_pad, KB_pad * bits]`` / ``scales [N_pad, KB_pad]``, ``BLOCKS`` (column, block)
  pairs per program (planes interleaved bit by bit into fields), padding with zero blocks.
* ``kbit_dequant_kernel``: the packed weight -> a dense ``[N, K]`` weight in the activation
  dtype (the large-M path: dequantize, then cuBLAS through ``F.linear``).
* ``kbit_gemm_kernel``: ``out [M, N] = x [M, K] @ W.T`` (+ bias) with the weight decoded tile
  by tile in registers (``dequant_tile``): each quad of blocks is loaded as one contiguous row
  of words, one shift and one mask per element give its field (the tile's k order is the
  words' order, ``quad_k``; x is read in the same order), the fields make the codebook index,
  the level is gathered from the codebook (16-128 bytes, L1 resident); times the block's E4M4
  scale, then ``tl.dot`` on tensor cores with fp32 accumulation. ``SWAP`` computes ``W @ x.T``
  (the decoded weight is the MMA's first operand: Hopper's wgmma reads it from registers, and
  BLOCK_N fills wgmma's M >= 64 when there are few tokens). Split-K CTAs add into a shared
  fp32 workspace and the last CTA of an output tile to arrive (an acq_rel ticket) reads the
  sums and writes zeros back, adds the bias and stores: one launch per matmul, no host
  synchronization (CUDA-graph capturable).
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantfw.kernels.common.splitk_epilogue import add_partial


@triton.jit
def _spread(x, F: tl.constexpr):
    """Bit ``t`` of ``x`` (``t < 32 / F``) moved to bit ``F * t`` (F = 2 or 4; a Morton
    spread: each step moves the upper half of every chunk up)."""
    if F == 2:  # 16 bits -> even bits
        x = (x | (x << 8)) & 0x00FF00FF
        x = (x | (x << 4)) & 0x0F0F0F0F
        x = (x | (x << 2)) & 0x33333333
        return (x | (x << 1)) & 0x55555555
    else:  # 8 bits -> every fourth bit
        x = (x | (x << 12)) & 0x000F000F
        x = (x | (x << 6)) & 0x03030303
        return (x | (x << 3)) & 0x11111111


@triton.jit
def kbit_repack_kernel(
    planes_ptr,  # int32 [N, KB, BITS]
    absmax_ptr,  # uint8 [N, KB]
    qweight_ptr,  # out: int32 [N_pad, KBP * BITS]
    scales_ptr,  # out: uint8 [N_pad, KBP]
    N,
    KB,
    KBP,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """grid (N_pad * KBP / BLOCKS,): (column, block) pairs ``b = n * KBP + kb``. Word ``j``
    of the ``F``-bit group interleaves bits ``(32 / F) * j ..`` of planes ``0 .. F - 1``; a
    1-bit group is plane ``F`` itself. Words land quad-interleaved (``layout.QUAD``)."""
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    n = b // KBP
    kb = b % KBP
    ok = (n < N) & (kb < KB)
    src = (n * KB + kb) * BITS
    dst = qweight_ptr + (b - b % 4) * BITS + b % 4  # word j at dst + 4 j (KBP % 4 == 0)
    HI: tl.constexpr = 4 if BITS >= 4 else 2  # the first group's field bits (= its words)
    LANES: tl.constexpr = 32 // HI
    planes = ()
    for i in tl.static_range(BITS):
        planes = planes + (tl.load(planes_ptr + src + i, mask=ok, other=0),)
    for j in tl.static_range(HI):
        word = tl.zeros([BLOCKS], dtype=tl.int32)
        for i in tl.static_range(HI):
            word |= _spread((planes[i] >> (LANES * j)) & ((1 << LANES) - 1), HI) << i
        tl.store(dst + 4 * j, word)
    if BITS % 2 == 1:
        tl.store(dst + 4 * HI, planes[HI])
    tl.store(scales_ptr + b, tl.load(absmax_ptr + src // BITS, mask=ok, other=0))


@triton.jit
def decode_e4m4(code):
    """uint8 E4M4 codes -> float32 (bias 11; exponent field 0: subnormal M * 2**-14)."""
    c = code.to(tl.int32)
    e = c >> 4
    m = c & 0xF
    normal = (((e + 116) << 23) | (m << 19)).to(tl.float32, bitcast=True)
    return tl.where(e > 0, normal, m.to(tl.float32) * 0.00006103515625)


@triton.jit
def quad_k(BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """The input offsets (from the tile's first input) of the positions of a `dequant_tile`.

    A tile is read quad by quad (``layout.QUAD``): position ``((q * 4 F + 4 j + r) * T + t)``
    (``F`` the first group's field bits, ``T = 32 / F``) holds element ``T j + t`` of block
    ``4 q + r``, so that each quad's words load as one contiguous row."""
    HI: tl.constexpr = 4 if BITS >= 4 else 2
    T: tl.constexpr = 32 // HI
    v = tl.arange(0, BLOCK_K)
    jr = (v // T) % (4 * HI)
    return 128 * (v // 128) + 32 * (jr % 4) + T * (jr // 4) + v % T


@triton.jit
def dequant_tile(
    qweight_ptr, scales_ptr, codebook_ptr, n, kb0, KBP, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """float32 ``[len(n), BLOCK_K]``: columns ``n`` of the weight at inputs ``32 * kb0 ..
    + BLOCK_K`` (all inside the padded weight; kb0 and BLOCK_K / 32 multiples of 4), in the
    order of `quad_k`."""
    BN: tl.constexpr = n.shape[0]
    Q: tl.constexpr = BLOCK_K // 128
    HI: tl.constexpr = 4 if BITS >= 4 else 2  # the first group's field bits (= its words)
    T: tl.constexpr = 32 // HI
    q = kb0 // 4 + tl.arange(0, Q)
    quad = n[:, None] * (KBP * BITS) + q[None, :] * (4 * BITS)  # [BN, Q] (< 2**31 words)
    jr = tl.arange(0, 4 * HI)  # word j of block r of the quad at 4 j + r
    w = tl.load(qweight_ptr + quad[:, :, None] + jr[None, None, :])  # [BN, Q, 4 HI]
    idx = (w[:, :, :, None] >> (tl.arange(0, T) * HI)[None, None, None, :]) & ((1 << HI) - 1)
    if BITS % 2 == 1:  # the 1-bit word of block r (at 4 HI + r): bit T j + t
        w1 = tl.load(qweight_ptr + quad[:, :, None] + (4 * HI + jr % 4)[None, None, :])
        bit = (jr // 4)[:, None] * T + tl.arange(0, T)[None, :]  # [4 HI, T]
        idx = idx | (((w1[:, :, :, None] >> bit[None, None, :, :]) & 1) << HI)
    block = n[:, None, None] * KBP + (4 * q)[None, :, None] + (jr % 4)[None, None, :]
    scale = decode_e4m4(tl.load(scales_ptr + block))  # [BN, Q, 4 HI]
    level = tl.load(codebook_ptr + idx)  # a 16-128 byte table: L1 resident
    return tl.reshape(level * scale[:, :, :, None], [BN, BLOCK_K])


@triton.jit
def kbit_dequant_kernel(
    qweight_ptr, scales_ptr, codebook_ptr, w_ptr, N, K, KBP,
    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``w [N, K]`` (its dtype) from the packed weight; grid (N_pad / BLOCK_N, K_pad / BLOCK_K)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb0 = tl.program_id(1) * (BLOCK_K // 32)
    w = dequant_tile(qweight_ptr, scales_ptr, codebook_ptr, n, kb0, KBP, BITS, BLOCK_K)
    # quad order [q, j, r, t] -> input order [q, r, j, t], so that the stores are whole rows
    HI: tl.constexpr = 4 if BITS >= 4 else 2
    w = tl.reshape(w, [BLOCK_N, BLOCK_K // 128, HI, 4, 32 // HI])
    w = tl.reshape(tl.permute(w, (0, 1, 3, 2, 4)), [BLOCK_N, BLOCK_K])
    k = kb0 * 32 + tl.arange(0, BLOCK_K)
    mask = (n < N)[:, None] & (k < K)[None, :]
    rows = n.to(tl.int64)[:, None] * K  # N * K may pass 2**31
    tl.store(w_ptr + rows + k[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def kbit_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, codebook_ptr, out_ptr, bias_ptr, ws_ptr, cnt_ptr,
    M, N, K, KBP, stride_xm, stride_om, ITERS, STEPS,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """grid (N_pad / BLOCK_N, split, M / BLOCK_M); CTA ``s`` of an output tile runs k steps
    (of BLOCK_K) ``s * ITERS ..`` up to ``STEPS = K_pad / BLOCK_K``. ``SPLIT_K``: more than
    one CTA per output tile (sum through the workspace)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = (m < M)[:, None]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + m[:, None] * stride_xm
    first = pid_s * ITERS
    for step in range(first, tl.minimum(first + ITERS, STEPS)):
        kb0 = step * (BLOCK_K // 32)
        k = kb0 * 32 + quad_k(BLOCK_K, BITS)  # x in the weight tile's order
        x = tl.load(x_rows + k[None, :], mask=m_ok & (k < K)[None, :], other=0.0)
        w = dequant_tile(qweight_ptr, scales_ptr, codebook_ptr, n, kb0, KBP, BITS, BLOCK_K).to(
            x.dtype
        )
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP:
        acc = tl.trans(acc)
    mask = m_ok & (n < N)[None, :]
    if SPLIT_K:
        cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        last, acc = add_partial(acc, ws_ptr, m[:, None] * N + n[None, :], mask, cnt,
                                tl.num_programs(1))  # fmt: skip
        if last:
            _store(acc, out_ptr, bias_ptr, m, n, mask, N, stride_om, HAS_BIAS)
    else:
        _store(acc, out_ptr, bias_ptr, m, n, mask, N, stride_om, HAS_BIAS)


@triton.jit
def _store(acc, out_ptr, bias_ptr, m, n, mask, N, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
