"""Grouped or dense GEMM of 4-bit weights x bf16 / fp16 activations on Hopper (sm_90) for
prefill and batches: the weights decoded in registers as the A operand of ``wgmma``, the rows
of activations streamed by TMA; no dequantized copy of the weights is written. The weights are
MXFP4 (E2M1 codes, UE8M0 block scales: `mxfp4.layout`) or kbit K = 4 (codebook indices, E4M4
block scales: `kbit.layout`, byte for byte the same runtime layout) or K = 2 (the same quads
with 2 words a block: ``WPQ`` 8 words a row and quad instead of 16; lanes c and c + 1 take the
halves of word c // 2) or K = 3, 5 (K = 2's or K = 4's words followed by the quad's four 1-bit
words, ``WPQ`` 12 or 20: the 1-bit words are copied by a TMA box of their own into a slot of
their own, and lane c takes byte c of its row's word); a launch's ``DECODE`` (inline PTX:
`dequantize.e2m1_word_bf16_asm`, `kbit.triton.wgmma.codebook_word_asm`) turns a lane's 8 codes
(and 1-bit fields) and their scale byte into 8 values.

``out[r] = x[r] @ W[e(r)].T (+ bias[e(r)])`` for rows sorted by expert, cut into BT-row blocks
(`kernels.moe.BlockPlan`), or with ``DENSE`` for the rows of one weight (block b: rows
``b BT ..``, no plan). A CTA computes ``W x^T`` for 128 output columns (two warpgroups of
64, sharing the x tiles) of one block, streaming K one quad (4 blocks of 32 inputs) per
pipeline stage: a TMA copy of the quad's weight words (``[128 rows, 16 or 8 words]`` of the
runtime ``qweight``, and ``[128, 4]`` 1-bit words at K = 3, 5) and two of x (``[BT, 64]``
each) land on the stage's mbarrier.

Fragment order. Per warp a wgmma A tile is the ``m16n8k16`` A fragment: lane ``4 g + c`` holds
rows g and g + 8 at k positions ``2 c + (0, 1)`` and ``2 c + 8 + (0, 1)`` of each k16 step.
Lane c decodes word c of each block of its two rows, i.e. inputs ``8 c + e`` (e = 0..7), and
uses them for the block's two k16 steps: input ``8 c + 4 s + 2 h + b`` goes to k position
``16 s + 8 h + 2 c + b`` of the block. The activations are copied into that order
(`input_order`: within each block of 32, position ``16 s + 8 h + 2 c + b`` holds input ``8 c +
4 s + 2 h + b``; for W13 in the same copy as the gather of the sorted rows, for W2 by the
activation kernel as it writes, `fused.GatedAct` with ``pairs_transposed``), so the sums are
those of ``x @ W.T``. In the quad interleave, words c of a quad's 4 blocks are 16 contiguous
bytes: one 16-byte shared-memory read per row and quad.

The tile's BT tokens run as BT / CH wgmma chunks of CH tokens (one accumulator each); a chunk
past the block's rows is not started, so an expert's last block costs its rows rounded up to
CH. Stage i decodes its A while stage i - 1's wgmmas run, then waits for all of them (their
number depends on the block) before starting its own. A stage's A registers are read by its
asynchronous wgmmas until that wait, so consecutive stages decode into different registers:
stages run in pairs (two SSA values, as in `w4a16/triton/wgmma.py`), with the last pair (or
an odd count's last stage) after the loop: with every pair inside it, ptxas serializes the
wgmmas (a wait after each), which `test_wgmma_kernel_keeps_its_wgmmas_asynchronous` checks in
the SASS. At K = 2, 3, 5 it serializes an odd count's loop too, so there the first stage runs
before the loop and the rest as an even count (``PEEL``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantfw.kernels.common import splitk
from quantfw.kernels.common.lanes import lane_in_quad
from quantfw.kernels.common.tma import words_descriptor
from quantfw.kernels.fused.reference import transpose_pairs
from quantfw.kernels.moe.sort import BlockPlan
from quantfw.kernels.mxfp4.triton.dequantize import e2m1_word_bf16_asm
from quantfw.kernels.w4a16.triton.mma import _finish_tile

#: output columns per CTA (two warpgroups of 64) and warps
BLOCK_N, NUM_WARPS = 128, 8
#: token rows per CTA the kernel supports (wgmma's N), and the default pipeline depth
BLOCK_TOKENS = (64, 128, 256)
DEFAULT_STAGES = 3
#: MXFP4's decode. A DECODE string takes, with pack = 8, $4..$11 the word (broadcast) and
#: $12..$19 its scale byte, and writes the 8 values as pairs to $0..$3; with a 1-bit word a
#: block (kbit K = 3, 5) that word is $12..$19 and the scale byte $20..$27
E2M1_DECODE = e2m1_word_bf16_asm(4, 12)
_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 16))
_CONSTRAINTS_ONES = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 24))
#: words per row and quad (``WPQ``) -> words of its first field group (copied in one box);
#: the rest, if any, is the quad's four 1-bit words (kbit K = 3, 5: `kbit.layout`)
MAIN_WORDS = {8: 8, 12: 8, 16: 16, 20: 16}


def input_order(x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous copy of x [T, K] (K a multiple of 32) in the kernel's k order, of the rows
    `rows` (all rows if None): position ``32 j + 16 s + 8 h + 2 c + b`` holds input ``32 j +
    8 c + 4 s + 2 h + b``, i.e. each block's 16 pairs of inputs transposed as a 4 x 4 matrix
    (`fused.transpose_pairs`). On CUDA one Triton kernel gathers and transposes
    (`_input_order_kernel`)."""
    t, k = x.shape
    if k % 32:
        raise ValueError(f"MXFP4 wgmma: activations {tuple(x.shape)}: K must be a multiple of 32")
    if x.is_cuda:
        return _input_order_triton(x, rows)
    return transpose_pairs(x if rows is None else x[rows]).contiguous()


#: blocks of 32 inputs per program of `_input_order_kernel`
_ORDER_BLOCKS = 32


@triton.jit
def _input_order_kernel(
    x_ptr, rows_ptr, out_ptr, G, stride_x, GATHER: tl.constexpr, BLOCK_G: tl.constexpr
):
    """grid (rows, G / BLOCK_G): out row r = x row rows[r] (or r) with each block's 16 int32
    pairs transposed as a 4 x 4 matrix."""
    r = tl.program_id(0).to(tl.int64)
    src = tl.load(rows_ptr + r).to(tl.int64) if GATHER else r
    blk = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    mask = (blk < G)[:, None]
    v = tl.load(x_ptr + src * stride_x + offs, mask=mask)
    v = tl.reshape(tl.permute(tl.reshape(v, [BLOCK_G, 4, 4]), [0, 2, 1]), [BLOCK_G, 16])
    tl.store(out_ptr + r * G * 16 + offs, v, mask=mask)


def _input_order_triton(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    if x.stride(-1) != 1 or x.element_size() != 2:
        raise ValueError(f"MXFP4 wgmma: input_order needs 16-bit rows, got {x.dtype}")
    t, k = x.shape
    n = t if rows is None else rows.numel()
    out = x.new_empty(n, k)
    if n == 0:
        return out
    g = k // 32
    pairs = x.view(torch.int32) if x.is_contiguous() else x.contiguous().view(torch.int32)
    grid = (n, triton.cdiv(g, _ORDER_BLOCKS))
    _input_order_kernel[grid](
        pairs, rows if rows is not None else pairs, out.view(torch.int32), g, pairs.stride(0),
        GATHER=rows is not None, BLOCK_G=_ORDER_BLOCKS, num_warps=4,
    )  # fmt: skip
    return out


@gluon.jit
def _decode_quad(
    words, ones, sc, DL: gl.constexpr, NW: gl.constexpr, DECODE: gl.constexpr,
    DTYPE: gl.constexpr, ONES: gl.constexpr,
):  # fmt: skip
    """A stage's A tile as two halves ``[16 NW, 64]`` (blocks 0, 1 and 2, 3 of the quad) from
    words ``[NW, 2 t, 8 g, 4 c, 4 r]`` (row 16 w + 8 t + g, word c of block r), with ONES their
    1-bit words, and their scale bytes (same shapes); k = 32 r + 16 s + 8 h + 2 c + b within
    the quad."""
    wb = gl.broadcast(gl.expand_dims(words, 5), gl.full([NW, 2, 8, 4, 4, 8], 0, gl.int32, DL))[0]
    sb = gl.broadcast(gl.expand_dims(sc, 5), wb)[0]
    if ONES:
        ob = gl.broadcast(gl.expand_dims(ones, 5), wb)[0]
        v = gl.inline_asm_elementwise(
            DECODE, _CONSTRAINTS_ONES, [wb, ob, sb], dtype=DTYPE.value, is_pure=True, pack=8
        )
    else:
        v = gl.inline_asm_elementwise(
            DECODE, _CONSTRAINTS, [wb, sb], dtype=DTYPE.value, is_pure=True, pack=8
        )
    # value e = 4 s + 2 h + b of word c of block r
    v = gl.reshape(v, [NW, 2, 8, 4, 2, 2, 2, 2, 2])  # w, t, g, c, r // 2, r % 2, s, h, b
    v = gl.permute(v, [0, 1, 2, 5, 6, 7, 3, 8, 4])  # w, t, g, r % 2, s, h, c, b, r // 2
    return gl.split(gl.reshape(v, [16 * NW, 64, 2]))


@gluon.jit
def _scales(s_ptr, s_off, q, q_end, DL: gl.constexpr):
    """The scale bytes of quad q of the thread's rows, ``[NW, 2, 8, 4, 4]`` int32 (one 4-byte
    load per row; zero past the last quad)."""
    # (s_off >= 0 always holds: it makes the mask a tensor of the offsets' layout)
    word = gl.load(s_ptr + s_off + q, mask=(s_off >= 0) & (q < q_end), other=0)
    WL: gl.constexpr = gl.SliceLayout(5, DL)
    r = gl.arange(
        0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WL))))
    )
    r = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 0), 1), 2), 3)
    return (gl.expand_dims(word, 4) >> (8 * r)) & 255


@gluon.jit
def _load_stage(
    j, x_desc, w_desc, o_desc, x_smem, w_smem, o_smem, bars, row0, wrow0, q0, n_iter,
    WPQ: gl.constexpr,
):  # fmt: skip
    """TMA copies of stage j (quad j, if it exists) into slot j % S: the weight words (the
    first field group's, and the 1-bit words into `o_smem` where WPQ has them) and the
    activation tile's two halves (all BT rows: loading only the chunks that hold rows cost
    more in barriers than it saved, benchmarks/mxfp4-lab-log.md §17)."""
    S: gl.constexpr = w_smem.shape[0]
    MW: gl.constexpr = w_smem.shape[2]
    BT: gl.constexpr = x_smem.shape[1]
    sj = j % S
    ok = j < n_iter
    bar = bars.index(sj)
    mbarrier.expect(bar, 128 * WPQ * 4 + BT * 128 * 2, pred=ok)
    tma.async_copy_global_to_shared(w_desc, [wrow0, (q0 + j) * WPQ], bar, w_smem.index(sj), pred=ok)
    if WPQ != MW:
        tma.async_copy_global_to_shared(
            o_desc, [wrow0, (q0 + j) * WPQ + MW], bar, o_smem.index(sj), pred=ok
        )
    for h in gl.static_range(2):
        tma.async_copy_global_to_shared(
            x_desc, [row0, (q0 + j) * 128 + 64 * h], bar, x_smem.index(2 * sj + h), pred=ok
        )


@gluon.jit
def _words(slot, NW: gl.constexpr, DL: gl.constexpr):
    """The thread's words of a stage's slot as ``[NW, 2 t, 8 g, 4 c, 4 r]`` (16-byte reads, no
    swizzle): word c of block r of its rows (16 words a row: 4-bit fields), or, with 8 words a
    row (kbit K = 2, 3: 2-bit fields, word j of block r at 4 j + r), word c // 2 shifted right
    by 16 (c % 2), so that the lane's 8 fields are its low half (lanes c, c + 1 read one word)."""
    MW: gl.constexpr = slot.shape[1]
    WL: gl.constexpr = gl.SliceLayout(5, DL)
    if MW == 16:
        view = slot._reinterpret(
            gl.int32, [NW, 2, 8, 4, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[4, 3, 2, 1, 0])
        )
        words = view.load(WL)
    else:
        view = slot._reinterpret(
            gl.int32, [NW, 2, 8, 2, 1, 4],
            gl.SwizzledSharedLayout(1, 1, 1, order=[5, 4, 3, 2, 1, 0]),
        )  # fmt: skip
        # lanes (j, half): both halves' lanes read word j
        HL: gl.constexpr = gl.BlockedLayout(
            [1, 2, 1, 1, 1, 4], [1, 1, 8, 2, 2, 1], [NW, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0]
        )
        w = view.load(HL)
        w = gl.broadcast(w, gl.full([NW, 2, 8, 2, 2, 4], 0, gl.int32, HL))[0]
        w = w >> (16 * (lane_in_quad(HL) % 2))
        words = gl.convert_layout(gl.reshape(w, [NW, 2, 8, 4, 4]), WL)
    return words


@gluon.jit
def _ones(slot, NW: gl.constexpr, DL: gl.constexpr):
    """The 1-bit words of a stage's slot (``[128 rows, 4 blocks]``, kbit K = 3, 5) as ``[NW, 2
    t, 8 g, 4 c, 4 r]``: lane c takes its rows' word of block r shifted right by 8 c, so that
    the 1-bit fields of its inputs 8 c .. 8 c + 7 are the low byte (the four lanes of a row
    read one word)."""
    WL: gl.constexpr = gl.SliceLayout(5, DL)
    view = slot._reinterpret(
        gl.int32, [NW, 2, 8, 1, 1, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[5, 4, 3, 2, 1, 0])
    )
    # lanes (j, half) of c = 2 j + half, as in `_words` with 8 words a row
    HL: gl.constexpr = gl.BlockedLayout(
        [1, 2, 1, 1, 1, 4], [1, 1, 8, 2, 2, 1], [NW, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0]
    )
    w = view.load(HL)
    w = gl.broadcast(w, gl.full([NW, 2, 8, 2, 2, 4], 0, gl.int32, HL))[0]
    w = w >> (8 * lane_in_quad(HL))
    return gl.convert_layout(gl.reshape(w, [NW, 2, 8, 4, 4]), WL)


@gluon.jit
def _chunk_mma(a0, a1, xs0, xs1, acc, j: gl.constexpr, CH: gl.constexpr):
    """Both halves of a stage on token rows ``j CH .. (j + 1) CH`` of the tile."""
    acc = warpgroup_mma(a0, xs0.slice(j * CH, CH).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(a1, xs1.slice(j * CH, CH).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _stage(
    i, acc0, acc1, acc2, acc3, sc, valid, x_desc, w_desc, o_desc, x_smem, w_smem, o_smem, bars,
    s_ptr, s_off, row0, wrow0, q0, q_end, n_iter, NW: gl.constexpr, DL: gl.constexpr,
    A_L: gl.constexpr, S: gl.constexpr, CH: gl.constexpr, NCH: gl.constexpr,
    DECODE: gl.constexpr, WPQ: gl.constexpr,
):  # fmt: skip
    """Stage i: decode quad i's A (its scales `sc` were loaded a stage ahead) while stage i -
    1's wgmmas run, retire those, start stage i's on the token chunks that hold rows (`valid`
    of the tile's rows do) and refill stage i - 1's slot with stage i + S - 1; returns the
    accumulators and quad i + 1's scales."""
    s = i % S
    sc_next = _scales(s_ptr, s_off, i + 1, q_end, DL)
    mbarrier.wait(bars.index(s), (i // S) & 1)
    ONES: gl.constexpr = w_smem.shape[2] != WPQ
    words = _words(w_smem.index(s), NW, DL)
    if ONES:
        ones = _ones(o_smem.index(s), NW, DL)
    else:
        ones = words
    a0, a1 = _decode_quad(words, ones, sc, DL, NW, DECODE, x_desc.dtype, ONES)
    a0 = gl.convert_layout(a0, A_L)
    a1 = gl.convert_layout(a1, A_L)
    # this warpgroup's wgmmas of stage i - 1 retire (a wait for all: the number of groups in
    # flight depends on how many chunks hold rows)
    acc0, acc1, acc2, acc3 = warpgroup_mma_wait(0, deps=(acc0, acc1, acc2, acc3))
    # (skipped chunks carry their retired sums under the in-flight type)
    acc1, acc2, acc3 = warpgroup_mma_init(acc1), warpgroup_mma_init(acc2), warpgroup_mma_init(acc3)
    xs0, xs1 = x_smem.index(2 * s), x_smem.index(2 * s + 1)
    acc0 = _chunk_mma(a0, a1, xs0, xs1, acc0, 0, CH)
    # constexpr guards outside, runtime tests inside: a chunk the tile lacks is never compiled
    if NCH > 1:  # noqa: SIM102
        if valid > CH:
            acc1 = _chunk_mma(a0, a1, xs0, xs1, acc1, 1, CH)
    if NCH > 2:
        if valid > 2 * CH:
            acc2 = _chunk_mma(a0, a1, xs0, xs1, acc2, 2, CH)
        if valid > 3 * CH:
            acc3 = _chunk_mma(a0, a1, xs0, xs1, acc3, 3, CH)
    # every warpgroup has retired stage i - 1's wgmmas and holds its words in registers
    gl.thread_barrier()
    _load_stage(
        i + S - 1, x_desc, w_desc, o_desc, x_smem, w_smem, o_smem, bars, row0, wrow0, q0,
        n_iter, WPQ,
    )  # fmt: skip
    return acc0, acc1, acc2, acc3, sc_next


@gluon.jit
def _store_chunk(
    acc, j: gl.constexpr, row0, row_end, n0, N, N_PAD, bias_ptr, out_ptr, ws_ptr, stride_om,
    CH: gl.constexpr, NW: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
    LAST: gl.constexpr,
):  # fmt: skip
    """Rows ``row0 + j CH ..`` of the tile (those before `row_end`), columns n0 .. n0 + 127:
    stored (+ bias), or with SPLIT added into the workspace ``[rows, N_PAD]`` (LAST False) and
    in the last CTA taken from it (`w4a16.triton.mma._finish_tile`)."""
    # tokens x columns, 8 consecutive columns per thread
    OL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    v = gl.convert_layout(gl.permute(acc, (1, 0)), OL)
    m = row0 + j * CH + gl.expand_dims(gl.arange(0, CH, layout=gl.SliceLayout(1, OL)), 1)
    n = n0 + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, OL)), 0)
    m = m.to(gl.int64)
    _finish_tile(
        v, out_ptr, ws_ptr, bias_ptr, m, n, m * N_PAD + n, m < row_end, N, stride_om, SPLIT,
        HAS_BIAS, LAST, True, SWAP=False,
    )  # fmt: skip


@gluon.jit
def _store_tile(
    acc0, acc1, acc2, acc3, valid, row0, row_end, n0, N, N_PAD, bias_ptr, out_ptr, ws_ptr,
    stride_om, CH: gl.constexpr, NCH: gl.constexpr, NW: gl.constexpr, SPLIT: gl.constexpr,
    HAS_BIAS: gl.constexpr, LAST: gl.constexpr,
):  # fmt: skip
    """`_store_chunk` of every chunk that holds rows."""
    _store_chunk(
        acc0, 0, row0, row_end, n0, N, N_PAD, bias_ptr, out_ptr, ws_ptr, stride_om, CH, NW,
        SPLIT, HAS_BIAS, LAST,
    )  # fmt: skip
    if NCH > 1:  # noqa: SIM102
        if valid > CH:
            _store_chunk(
                acc1, 1, row0, row_end, n0, N, N_PAD, bias_ptr, out_ptr, ws_ptr, stride_om, CH,
                NW, SPLIT, HAS_BIAS, LAST,
            )  # fmt: skip
    if NCH > 2:
        if valid > 2 * CH:
            _store_chunk(
                acc2, 2, row0, row_end, n0, N, N_PAD, bias_ptr, out_ptr, ws_ptr, stride_om, CH,
                NW, SPLIT, HAS_BIAS, LAST,
            )  # fmt: skip
        if valid > 3 * CH:
            _store_chunk(
                acc3, 3, row0, row_end, n0, N, N_PAD, bias_ptr, out_ptr, ws_ptr, stride_om, CH,
                NW, SPLIT, HAS_BIAS, LAST,
            )  # fmt: skip


@gluon.jit
def mxfp4_wgmma_kernel(
    x_desc,  # TMA descriptor of x [R, K] bf16 / fp16 in `input_order`, block [BT, 64]
    w_desc,  # TMA descriptor of qweight viewed [E * N_pad, WPR] int32, block [128, MW]
    o_desc,  # the same in blocks [128, 4] (the 1-bit words of kbit K = 3, 5; else unused)
    s_ptr,  # scales viewed int32 [E * N_pad, WPR / WPQ] (4 scale bytes per quad)
    bias_ptr,
    out_ptr,  # [R, N], x's dtype
    ws_ptr,  # fp32 split-K workspace [R, N_PAD] (zeros; read with SPLIT > 1)
    cnt_ptr,  # int32 arrival counters (zeros), one per output tile
    block_expert_ptr,  # (unused with DENSE)
    block_row_ptr,  # (unused with DENSE)
    m_indptr_ptr,  # (unused with DENSE)
    num_rows,  # R (read with DENSE)
    N,
    N_PAD,
    n_quads,  # quads per row (WPR / WPQ)
    n_iter,  # quads per CTA: CTA sp of SPLIT takes quads sp n_iter .. (zeros past n_quads)
    num_experts,
    stride_be,
    stride_om,
    BT: gl.constexpr,
    CH: gl.constexpr,  # token rows per wgmma (BT, BT / 2 or BT / 4): chunks past the block's
    # rows are skipped
    S: gl.constexpr,
    ODD: gl.constexpr,  # n_iter is odd
    PEEL: gl.constexpr,  # an odd n_iter > 1 whose first stage runs before the loop (WPQ != 16)
    HAS_BIAS: gl.constexpr,
    DECODE: gl.constexpr,  # inline PTX of one word and its scale byte (see E2M1_DECODE)
    DENSE: gl.constexpr,  # one weight, block b = rows b BT .. (no plan)
    WPQ: gl.constexpr,  # words per row and quad: 16 (4-bit fields), kbit K = 2, 3, 5: 8, 12, 20
    SPLIT: gl.constexpr,  # CTAs per output tile along K (grid axis 2)
):
    NW: gl.constexpr = 8
    pid_n = gl.program_id(0)
    blk = gl.program_id(1)
    q0 = gl.program_id(2) * n_iter
    q_end = n_quads - q0
    if DENSE:
        expert = gl.to_tensor(0)
        row0 = blk * BT
        row_end = num_rows
    else:
        expert = gl.load(block_expert_ptr + blk)
        if expert >= num_experts:
            return
        row0 = gl.load(block_row_ptr + blk)
        row_end = gl.load(m_indptr_ptr + expert + 1).to(gl.int32)
    n0 = pid_n * 128
    wrow0 = expert * N_PAD + n0

    # decode layout [warp, t, g, c, r, e]: lane 4 g + c, rows 16 w + 8 t + g, value e of word c
    DL: gl.constexpr = gl.BlockedLayout(
        [1, 2, 1, 1, 4, 8], [1, 1, 8, 4, 1, 1], [NW, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0]
    )
    NCH: gl.constexpr = BT // CH
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, CH, 16]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * S, BT, 64], x_desc.layout)
    MW: gl.constexpr = w_desc.block_shape[1]  # the host's box: `MAIN_WORDS`
    w_smem = gl.allocate_shared_memory(gl.int32, [S, 128, MW], w_desc.layout)
    if WPQ != MW:
        o_smem = gl.allocate_shared_memory(gl.int32, [S, 128, 4], o_desc.layout)
    else:
        o_smem = w_smem
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(S):
        mbarrier.init(bars.index(b), count=1)

    # the thread's scale words: row wrow0 + 16 w + 8 t + g of scales [E * N_pad, n_iter]
    SL4: gl.constexpr = gl.SliceLayout(4, gl.SliceLayout(5, DL))
    w_i = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, SL4))))
    t_i = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, SL4))))
    g_i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, SL4))))
    c_i = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, SL4))))
    w4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(w_i, 1), 2), 3)
    t4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(t_i, 0), 2), 3)
    g4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(g_i, 0), 1), 3)
    c4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(c_i, 0), 1), 2)
    srow = wrow0 + 16 * w4 + 8 * t4 + g4 + 0 * c4
    # rows past this expert's N_pad belong to the next one (their outputs are not stored)
    srow = gl.minimum(srow, num_experts * N_PAD - 1)
    s_off = srow.to(gl.int64) * n_quads + q0

    valid = gl.minimum(row_end - row0, BT)
    for b in gl.static_range(S - 1):
        _load_stage(
            b, x_desc, w_desc, o_desc, x_smem, w_smem, o_smem, bars, row0, wrow0, q0, n_iter,
            WPQ,
        )  # fmt: skip

    acc0 = warpgroup_mma_init(gl.zeros([128, CH], gl.float32, MMA))
    acc1, acc2, acc3 = acc0, acc0, acc0  # chunks past NCH stay unused
    sc = _scales(s_ptr, s_off, 0, q_end, DL)
    # an even count's last pair and an odd count's last stage after the loop; a peeled odd
    # count runs its first stage before the loop and then as an even one (see the module
    # docstring; benchmarks/kbit-lab-log.md §37-38)
    if PEEL:
        acc0, acc1, acc2, acc3, sc = _stage(
            0, acc0, acc1, acc2, acc3, sc, valid, x_desc, w_desc, o_desc, x_smem, w_smem,
            o_smem, bars, s_ptr, s_off, row0, wrow0, q0, q_end, n_iter, NW, DL, A_L, S, CH, NCH,
            DECODE, WPQ,
        )  # fmt: skip
    # (an int, not a bool: a constexpr bool start is sign-extended to -1)
    START: gl.constexpr = 1 if PEEL else 0
    AFTER: gl.constexpr = 1 if ODD and not PEEL else 2
    for i in range(START, n_iter - AFTER, 2):
        acc0, acc1, acc2, acc3, sc = _stage(
            i, acc0, acc1, acc2, acc3, sc, valid, x_desc, w_desc, o_desc, x_smem, w_smem,
            o_smem, bars, s_ptr, s_off, row0, wrow0, q0, q_end, n_iter, NW, DL, A_L, S, CH, NCH,
            DECODE, WPQ,
        )  # fmt: skip
        acc0, acc1, acc2, acc3, sc = _stage(
            i + 1, acc0, acc1, acc2, acc3, sc, valid, x_desc, w_desc, o_desc, x_smem, w_smem,
            o_smem, bars, s_ptr, s_off, row0, wrow0, q0, q_end, n_iter, NW, DL, A_L, S, CH, NCH,
            DECODE, WPQ,
        )  # fmt: skip
    if PEEL or not ODD:
        acc0, acc1, acc2, acc3, sc = _stage(
            n_iter - 2, acc0, acc1, acc2, acc3, sc, valid, x_desc, w_desc, o_desc, x_smem, w_smem,
            o_smem, bars, s_ptr, s_off, row0, wrow0, q0, q_end, n_iter, NW, DL, A_L, S, CH, NCH,
            DECODE, WPQ,
        )  # fmt: skip
    acc0, acc1, acc2, acc3, sc = _stage(
        n_iter - 1, acc0, acc1, acc2, acc3, sc, valid, x_desc, w_desc, o_desc, x_smem, w_smem,
        o_smem, bars, s_ptr, s_off, row0, wrow0, q0, q_end, n_iter, NW, DL, A_L, S, CH, NCH,
        DECODE, WPQ,
    )  # fmt: skip
    acc0, acc1, acc2, acc3 = warpgroup_mma_wait(0, deps=(acc0, acc1, acc2, acc3))
    for b in gl.static_range(S):
        mbarrier.invalidate(bars.index(b))

    bias_ptr = bias_ptr + expert.to(gl.int64) * stride_be
    if SPLIT > 1:
        _store_tile(
            acc0, acc1, acc2, acc3, valid, row0, row_end, n0, N, N_PAD, bias_ptr, out_ptr,
            ws_ptr, stride_om, CH, NCH, NW, SPLIT, HAS_BIAS, False,
        )  # fmt: skip
        gl.thread_barrier()
        cnt = cnt_ptr + blk * gl.num_programs(0) + pid_n
        ticket = gl.atomic_add(cnt, 1, sem="acq_rel")
        if ticket == SPLIT - 1:
            gl.atomic_xchg(cnt, 0, sem="relaxed")
            _store_tile(
                acc0, acc1, acc2, acc3, valid, row0, row_end, n0, N, N_PAD, bias_ptr, out_ptr,
                ws_ptr, stride_om, CH, NCH, NW, SPLIT, HAS_BIAS, True,
            )  # fmt: skip
    else:
        _store_tile(
            acc0, acc1, acc2, acc3, valid, row0, row_end, n0, N, N_PAD, bias_ptr, out_ptr,
            ws_ptr, stride_om, CH, NCH, NW, SPLIT, HAS_BIAS, True,
        )  # fmt: skip


def options(config: dict) -> dict:
    """`grouped_gemm`'s keyword options from a ``WGMMA`` config of
    `triton.grouped_gemm.default_config`."""
    return {"stages": config.get("stages", DEFAULT_STAGES), "chunk": config.get("chunk")}


def grouped_gemm(
    x: torch.Tensor,
    weights,
    plan: BlockPlan,
    *,
    bias: torch.Tensor | None = None,
    stages: int = DEFAULT_STAGES,
    chunk: int | None = None,
) -> torch.Tensor:
    """out [plan.num_rows, N] bf16: row r of expert e is ``x[r] @ W[e].T + bias[e]``, for x
    [R, K] bf16 in `input_order` (rows sorted as the plan's) and `weights` a
    `grouped.Mxfp4Weights` of experts [E, N, K]; BT = ``plan.block_m`` tokens per CTA."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"MXFP4 wgmma: activations must be bf16, got {x.dtype}")
    num_experts, n, _ = weights.shape
    return _launch(
        x, weights.qweight, weights.scales, n, plan.block_m, stages, chunk, E2M1_DECODE,
        bias, plan, num_experts, weights,
    )  # fmt: skip


def dense_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    decode: str,
    *,
    bias: torch.Tensor | None = None,
    block_tokens: int = 128,
    stages: int = DEFAULT_STAGES,
    chunk: int | None = None,
    owner: object | None = None,
    words_per_block: int = 4,
) -> torch.Tensor:
    """out [R, n] = ``x @ W.T (+ bias)`` for one weight W [n, K] in the runtime layout
    (``qweight int32 [N_pad, KB_pad * words_per_block]``: 4 words of 4-bit fields a block, or
    2 of 2-bit fields for kbit K = 2; ``scales uint8 [N_pad, KB_pad]``), x [R, K] bf16 or fp16
    in `input_order`; `decode` the PTX of the 8 fields a lane takes (`E2M1_DECODE` for MXFP4,
    which needs bf16; `kbit.triton.wgmma.codebook_word_asm`); `owner`: the object holding
    qweight for the life of the weight, which keeps its TMA descriptor (built once)."""
    if decode == E2M1_DECODE and x.dtype != torch.bfloat16:
        raise ValueError(f"MXFP4 wgmma: activations must be bf16, got {x.dtype}")
    if 4 * words_per_block not in MAIN_WORDS:
        raise ValueError(
            f"4-bit wgmma: words_per_block={words_per_block}; supported: 2, 3, 4, 5 (kbit K)"
        )
    return _launch(
        x, qweight, scales, n, block_tokens, stages, chunk, decode, bias, None, 1, owner,
        4 * words_per_block,
    )  # fmt: skip


@functools.cache
def _x_layout(bt: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(
        [bt, 64], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    )


def peel_first_stage(n_iter: int, wpq: int) -> bool:
    """Whether a launch of `n_iter` stages a CTA runs its first stage before the loop: odd
    counts past one with other than 16 words a row and quad (kbit K = 2, 3, 5), which ptxas
    serializes otherwise. K = 4 and MXFP4 keep the plain odd loop, which it does not serialize
    and which was faster than the peeled one (benchmarks/kbit-lab-log.md §37)."""
    return n_iter % 2 == 1 and n_iter > 1 and wpq != 16


def _launch(
    x, qweight, scales, n, bt, stages, chunk, decode, bias, plan, num_experts, owner=None,
    wpq=16,
) -> torch.Tensor:  # fmt: skip
    if bt not in BLOCK_TOKENS:
        raise ValueError(f"4-bit wgmma: {bt} tokens per tile; supported: {BLOCK_TOKENS}")
    chunk = chunk or bt
    if chunk < 32 or bt % chunk or bt // chunk > 4:
        raise ValueError(
            f"4-bit wgmma: chunk = {chunk} for {bt}-token tiles; supported: {bt}, {bt // 2} or "
            f"{bt // 4}, at least 32"
        )
    rows = x.shape[0] if plan is None else plan.num_rows
    n_pad, wpr = qweight.shape[-2:]
    k = x.shape[-1]
    if (
        x.dtype not in (torch.bfloat16, torch.float16)
        or x.shape != (rows, k)
        or k > 128 * wpr // wpq
        or not x.is_contiguous()
    ):
        raise ValueError(
            f"4-bit wgmma: x must be contiguous bf16 or fp16 [{rows}, K <= {128 * wpr // wpq}], "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x_desc = TensorDescriptor.from_tensor(x, [bt, 64], _x_layout(bt, x.dtype))
    # the quad's words, 128 rows (the weights viewed [E * N_pad, WPR])
    words = qweight.view(num_experts * n_pad, wpr)
    mw = MAIN_WORDS[wpq]
    w_desc = words_descriptor(words, [128, mw], owner)
    o_desc = words_descriptor(words, [128, 4], owner) if wpq != mw else w_desc
    n_quads = wpr // wpq
    blocks = triton.cdiv(rows, bt) if plan is None else plan.num_blocks
    n_tiles = triton.cdiv(n, BLOCK_N)
    split, n_iter = 1, n_quads
    if plan is None:  # a dense launch of too few tiles splits K (one CTA per SM fits)
        split, n_iter = splitk.split_plan(n_quads, n_tiles * blocks, splitk.num_sms(x.device), 1)
    ws, cnt = splitk.workspace(
        x.device, rows * n_pad if split > 1 else 1, n_tiles * blocks if split > 1 else 1
    )
    # (a dense launch passes `out` for the plan's pointers: never read)
    ptrs = (out, out, out) if plan is None else (plan.block_expert, plan.block_row, plan.m_indptr)
    mxfp4_wgmma_kernel[(n_tiles, blocks, split)](
        x_desc, w_desc, o_desc, scales.view(torch.int32), bias if bias is not None else out, out,
        ws, cnt, *ptrs, rows, n, n_pad, n_quads, n_iter, num_experts,
        bias.stride(0) if bias is not None and plan is not None else 0, out.stride(0),
        BT=bt, CH=chunk, S=stages, ODD=n_iter % 2 == 1, PEEL=peel_first_stage(n_iter, wpq),
        HAS_BIAS=bias is not None,
        DECODE=decode, DENSE=plan is None, WPQ=wpq, SPLIT=split, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
