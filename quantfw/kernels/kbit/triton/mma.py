"""Gluon kernel for kbit (K = 2..5) and MXFP4 at small M: codebook lookups from a
shared-memory table straight into ``mma.sync`` fragments, the block scale (E4M4, or MXFP4's
UE8M0) applied once per block.

It reads the field-packed layout of ``kbit/layout.py`` as it is (no second copy of a weight):
``qweight int32 [N_pad, KB_pad * bits]`` (column n, block b: ``bits`` words; K = 4, 5: word
``w < 4`` holds elements ``8w .. 8w + 7`` as nibbles; K = 2, 3: word ``w < 2`` holds elements
``16w .. 16w + 15`` as 2-bit fields; K = 3, 5: the last word holds element ``t``'s 1-bit field
at bit t; quad-interleaved, so word w of 4 consecutive blocks is one 16-byte load) and
``scales uint8 [N_pad, KB_pad]`` read as int32 (4 blocks per word).

The mma runs transposed as the W4A16 kernel's (``w4a16/triton/mma.py``): 16 output columns x
k16 of weights as A, x as B (k16 x 8 tokens).  A k16 step is *virtual*: lane ``l = 4g + c``
supplies the elements ``8c + 4v .. 8c + 4v + 3`` of a block as the step ``v`` (0, 1) of that
block, and x is read with the same permutation, so each lane reads one field word (K = 4, 5)
or half of one (K = 2, 3) per column and block, plus byte c of the 1-bit word (K = 3, 5), and
every byte it reads is used:

* K = 4: byte ``2v`` of word c (elements ``8c + 4v``, ``+1``) is A register (k 2c), byte
  ``2v + 1`` register (k 2c + 8).
* K = 2: byte ``2 (c % 2) + v`` of word ``c // 2`` holds the 4 elements: both registers. In
  16-token tiles `pair_columns` first puts the low nibbles of columns g's and g + 8's bytes
  in one byte and the high nibbles in another, so that each 8-byte entry is A register (k 2c)
  or (k 2c + 8) of both columns, side by side as the mma takes them (an entry per column
  needs register moves).
* K = 5: as K = 4, with the two elements' 1-bit fields as index bits 8, 9; K = 3: the nibble
  of the two 2-bit fields (of K = 2's byte), the 1-bit fields as index bits 4, 5.

A table entry (a byte at K = 2, 4; 10 or 6 bits at K = 5, 3) is decoded by one load from a
table in shared memory (``lut``: per entry the 2 (K = 3, 4, 5) or 4 (K = 2) levels it
encodes, times 16, in x's dtype, packed as the registers want them), kept in ``R`` copies
(copy ``lane % R``) against bank conflicts.  The table lives at the
start of the CTA's shared memory (``global_smem``), the kernel's largest allocation; the inline
PTX addresses it directly.

Each block's two mma steps go into a fresh fp32 sum that is folded into the accumulator with
the block's scale: E4M4 ``e m`` shifted left by 6 is the fp16 ``absmax / 16`` exactly
(subnormals included), hence the table's factor 16; UE8M0 ``e`` shifted left by 23 is the fp32
``2**(e - 127)`` (table factor 1).  The ``WK`` warps of a CTA that share a 64-column block
take turns over its chunks and add their sums in shared memory after the loop (the W4A16
kernel's ``_sum_k_slices``, over the table's bytes); a split across CTAs meets in the W4A16
kernel's self-cleaning workspace.

Weight words reach the registers one of two ways. Register loads: a warp loads its next
chunk's words after the chunk's math, and waits for them at the next chunk's first lookup.
TMA staging (`tma_staging`: sm_90, K = 2, 4, 5 and MXFP4, 8-token tiles; 16-token ones where
`staged_tile16` picks them): the CTA's words of one iteration (WK boxes of [64 rows, a quad's
field words], 8 or 16 words a row, and at K = 3, 5 WK boxes of its four 1-bit words into a
second slot) land in shared memory on an mbarrier;
the warps copy them to registers (at K = 2, 3 lanes c and c + 1 read the same word, as their
register loads do), a CTA barrier frees the slots, and TMA refills them with the next
iteration while this one computes (`_tma_words`). Dense launches stage the iteration's scale
words the same way (one [64 rows, WK words] box, ``S_TMA``, where the scale rows are whole
16-byte units: `scales_by_tma`); grouped ones load them.

MXFP4 blocks are kbit K = 4 blocks byte for byte (16 bytes, element 2i in the low nibble of
byte i), so `mxfp4.layout` only pads and quad-interleaves them, and the table holds the E2M1
values.  With ``GROUPED`` the token tiles are the row blocks of a grouped GEMM over experts
(`kernels.moe.BlockPlan`): each reads its expert's weights, scales and bias, gathers its x rows
(``GATHER``) and stores its sorted rows (`grouped_lut_mma`).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from quantfw.kernels.common import cuda_capability, pdl, splitk
from quantfw.kernels.common.lanes import lane_in_quad
from quantfw.kernels.common.tma import words_descriptor
from quantfw.kernels.fused import GatedAct
from quantfw.kernels.kbit.configs import MMA_BITS
from quantfw.kernels.kbit.layout import GATED_GROUP, _as_int32
from quantfw.kernels.moe.sort import BlockPlan
from quantfw.kernels.w4a16.triton.mma import (
    _mma,
    _reduced_tok_n,
    _sum_k_slices,
    _tile_coords,
    _workspace,
    _zeros,
    as_int32_pairs,
    epilogue_rows,
    fragment_tok_n,
)

#: elements per chunk of the K loop are CH blocks of 32; scales come as 4 blocks per word
SCALE_BLOCKS = gl.constexpr(4)
_ACT_CODES = {"silu": 1, "swiglu_oai": 2}
#: bit widths whose gated pairs keep the separate activation kernel (none: every K's epilogue
#: is checked against it by `test_gpu_gated_epilogue_matches_the_separate_activation`)
SEPARATE_ACT_BITS: tuple[int, ...] = ()


@constexpr_function
def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@constexpr_function
def _table_entries(bits: int) -> int:
    """Entries of the lookup table: a byte of fields (K = 2, 4), or two elements' fields and
    1-bit fields (K = 3: 4 + 2 bits, K = 5: 8 + 2 bits)."""
    return {2: 256, 3: 64, 4: 256, 5: 1024}[bits]


@constexpr_function
def _lookup_asm(bits: int, r: int, v: int, copies: int, paired: bool = False) -> str:
    """PTX: A registers $0..$3 of block ``r`` (of the bundles) and step ``v`` for the columns
    g (field-word bundle $4..$7, 1-bit-word bundle $12..$15) and g + 8 ($8..$11, $16..$19);
    $20: the lane's table base address, $24, $25 (K = 2): its byte selectors of steps 0 and 1.
    Register p = 2 h + e holds elements ``8c + 4v + 2e``, ``+ 1`` of column g + 8h.  With
    ``paired`` (K = 2) the bundles are `pair_columns`' (e = 0: $4..$7, e = 1: $8..$11): an
    8-byte entry fills registers e and 2 + e."""
    stride = 4 * copies * (2 if bits == 2 else 1)  # bytes per table entry, all copies
    load = f"mad.lo.u32 t, t, {stride}, $20; ld.shared.b32"
    if bits == 2:  # entry i from bundle i: registers 2i, 2i + 1 (column g + 8i), or i, 2 + i
        dests = [(i, 2 + i) if paired else (2 * i, 2 * i + 1) for i in range(2)]
        out = [
            f"prmt.b32 t, ${4 * (i + 1) + r}, 0, ${24 + v}; mad.lo.u32 t, t, {stride}, $20;"
            f" ld.shared.v2.b32 {{${a}, ${b}}}, [t];"
            for i, (a, b) in enumerate(dests)
        ]
    elif bits == 4:  # the byte 2v + e of the word
        out = [
            f"prmt.b32 t, ${4 + 4 * (p // 2) + r}, 0, {0x4440 + 2 * v + p % 2:#x}; {load} ${p}, [t];"
            for p in range(4)
        ]
    elif bits == 5:  # that byte, and the two elements' 1-bit fields as index bits 8, 9
        out = [
            f"prmt.b32 t, ${4 + 4 * (p // 2) + r}, 0, {0x4440 + 2 * v + p % 2:#x};"
            f" bfe.u32 u, ${12 + 4 * (p // 2) + r}, {4 * v + 2 * (p % 2)}, 2;"
            f" bfi.b32 t, u, t, 8, 2; {load} ${p}, [t];"
            for p in range(4)
        ]
    else:  # K = 3: the two 2-bit fields (a nibble), the 1-bit fields as index bits 4, 5
        out = [
            f"bfe.u32 t, ${4 + 4 * (p // 2) + r}, {8 * v + 4 * (p % 2)}, 4;"
            f" bfe.u32 u, ${12 + 4 * (p // 2) + r}, {4 * v + 2 * (p % 2)}, 2;"
            f" bfi.b32 t, u, t, 4, 2; {load} ${p}, [t];"
            for p in range(4)
        ]
    return "{ .reg .b32 t, u;\n" + "\n".join(out) + " }"


@constexpr_function
def _scale_fold_asm(j: int, r: int, ue8m0: bool) -> str:
    """PTX: $0..$3 = acc ($4..$7) + s * partial ($8..$11), s the scale of columns g ($0, $1)
    and g + 8 ($2, $3) of word j: byte ``r`` of scale-bundle registers 2 (j % 2) and
    2 (j % 2) + 1 ($12..$15).  E4M4 ``e m`` shifted left by 6 is the fp16 ``absmax / 16``;
    UE8M0 ``e`` shifted left by 23 is the fp32 ``2**(e - 127)`` (e = 0: the subnormal
    2**-127, 0x00400000)."""
    a, b = 12 + 2 * (j % 2), 13 + 2 * (j % 2)
    if ue8m0:
        decode = (
            "and.b32 s, s, 0x00ff00ff; shl.b32 u, s, 23; shr.b32 s, s, 16; shl.b32 s, s, 23;\n"
            "max.u32 u, u, 0x00400000; max.u32 s, s, 0x00400000;\n"
            "mov.b32 s0, u; mov.b32 s1, s;\n"
        )
    else:
        decode = (
            "and.b32 s, s, 0x00ff00ff; shl.b32 s, s, 6;\n"
            "mov.b32 {lo, hi}, s; cvt.f32.f16 s0, lo; cvt.f32.f16 s1, hi;\n"
        )
    return (
        "{ .reg .b32 s, u; .reg .b16 lo, hi; .reg .f32 s0, s1;\n"
        f"prmt.b32 s, ${a}, ${b}, {r + ((4 + r) << 8):#x};\n"
        + decode
        + "fma.rn.f32 $0, s0, $8, $4; fma.rn.f32 $1, s0, $9, $5;\n"
        "fma.rn.f32 $2, s1, $10, $6; fma.rn.f32 $3, s1, $11, $7; }"
    )


_LOOKUP_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 24))
_FOLD_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 4 + ["f"] * 8 + ["r"] * 4))
_BASE_ASM = gl.constexpr("{ .reg .b32 b; mov.u32 b, global_smem; add.u32 $0, $1, b; }")


@gluon.jit
def _lookup(
    w0, w1, h0, h1, lb, sel, R: gl.constexpr, V: gl.constexpr, BITS: gl.constexpr,
    COPIES: gl.constexpr, PAIR: gl.constexpr,
):  # fmt: skip
    asm: gl.constexpr = _lookup_asm(BITS, R, V, COPIES, PAIR)
    return gl.inline_asm_elementwise(
        asm, _LOOKUP_CONSTRAINTS, [w0, w1, h0, h1, lb, sel], dtype=gl.int32, is_pure=True,
        pack=4,
    )  # fmt: skip


#: PTX of `pair_columns`: lop3 0xE4 is (a & c) | (b & ~c)
PAIR_COLUMNS_ASM = gl.constexpr(
    "{ .reg .b32 t; shl.b32 t, $3, 4; lop3.b32 $0, $2, t, 0x0F0F0F0F, 0xE4;\n"
    "shr.u32 t, $2, 4; lop3.b32 $1, t, $3, 0x0F0F0F0F, 0xE4; }"
)


@gluon.jit
def pair_columns(w0, w1):
    """K = 2's lookup bytes from the field words of columns g (``w0``) and g + 8 (``w1``):
    byte k of the first holds the low nibbles of the two words' bytes k (their first two
    elements' fields, column g's as the low nibble), byte k of the second their high nibbles,
    so that one table entry (`lookup_table`: a byte's four fields in order) is the same A
    register of both columns. Two instructions a word (a shift and a `lop3`)."""
    return gl.inline_asm_elementwise(
        PAIR_COLUMNS_ASM, "=r,=r,r,r", [w0, w1], dtype=(gl.int32, gl.int32), is_pure=True,
        pack=1,
    )  # fmt: skip


@gluon.jit
def _scale_fold(acc, part, sb, J: gl.constexpr, R: gl.constexpr, UE8M0: gl.constexpr):
    asm: gl.constexpr = _scale_fold_asm(J, R, UE8M0)
    return gl.inline_asm_elementwise(
        asm, _FOLD_CONSTRAINTS, [acc, part, sb], dtype=gl.float32, is_pure=True, pack=4
    )


@gluon.jit
def _load_weights(
    q_ptr, s_ptr, b0, q_off, h_off, c, s_off, nb_ok, KBP, KBS, CH: gl.constexpr,
    BITS: gl.constexpr, MASK: gl.constexpr,
):  # fmt: skip
    """The weight and scale loads of the chunk of CH blocks from block ``b0``: per 4 blocks
    (quad q) the field-word bundles of word j, t (``ws[NW q + 2 j + t]``, register = block;
    ``NW`` 8, or 16 for K = 3, 5, whose 1-bit-word bundles follow at ``NW q + 8 + 2 j + t``),
    scale bundles (per 4 blocks: j < 2, j >= 2; register 2 (j % 2) + t).  Words come
    shifted so that the lane's bits start at bit 0: K = 3's field word by 16 (c % 2), the
    1-bit word by 8 c."""
    ws = ()
    ss = ()
    for q4 in gl.static_range(CH // SCALE_BLOCKS):
        bq = b0 + SCALE_BLOCKS * q4
        ok = nb_ok & (bq < KBP) if MASK else nb_ok
        hs = ()
        for jt in gl.static_range(8):
            at = (16 * (jt // 2) + 8 * (jt % 2)) * (KBP * BITS) + bq * BITS
            w = gl.load(q_ptr + q_off + at, mask=ok, other=0)
            if BITS == 3:
                w = w >> (16 * (c % 2))
            ws = ws + (w,)
            if BITS % 2 == 1:
                hs = hs + (gl.load(q_ptr + h_off + at, mask=ok, other=0) >> (8 * c),)
        ws = ws + hs
        ss = ss + _load_scales(s_ptr, bq, s_off, nb_ok, KBP, KBS, MASK)
    return ws, ss


@gluon.jit
def _load_x(x_ptr, b0, x_off, x_pair, K2, CH: gl.constexpr, TM: gl.constexpr):
    """The x loads of the chunk: TM = 8: one bundle per block, registers = its 4 pairs;
    TM = 16: one per block and step."""
    xs = ()
    for r in gl.static_range(CH):
        xp = (b0 + r) * 16
        if TM == 8:
            xs = xs + (gl.load(x_ptr + x_off + xp, mask=x_pair + xp < K2, other=0),)
        else:
            for v in gl.static_range(2):
                xk = x_pair + xp + 2 * v
                xs = xs + (gl.load(x_ptr + x_off + xp + 2 * v, mask=xk < K2, other=0),)
    return xs


@gluon.jit
def _load_chunk(
    q_ptr, x_ptr, s_ptr, b0, q_off, h_off, c, x_off, x_pair, s_off, nb_ok, KBP, KBS, K2,
    CH: gl.constexpr, TM: gl.constexpr, BITS: gl.constexpr, MASK: gl.constexpr,
):  # fmt: skip
    """Every load of the chunk of CH blocks from block ``b0``: `_load_weights`, `_load_x`."""
    ws, ss = _load_weights(
        q_ptr, s_ptr, b0, q_off, h_off, c, s_off, nb_ok, KBP, KBS, CH, BITS, MASK
    )
    xs = _load_x(x_ptr, b0, x_off, x_pair, K2, CH, TM)
    return ws, xs, ss


@gluon.jit
def _chunk(
    ws, xs, ss, accs, lb, sel, W: gl.constexpr, L3: gl.constexpr, CH: gl.constexpr,
    TM: gl.constexpr, BITS: gl.constexpr, COPIES: gl.constexpr, IS_BF16: gl.constexpr,
    UE8M0: gl.constexpr, PAIR: gl.constexpr,
):  # fmt: skip
    """The CH blocks of a chunk: per block and word j, two mma steps into a fresh partial sum,
    then acc += scale * partial (``PAIR``: K = 2's words through `pair_columns` first)."""
    NH: gl.constexpr = TM // 8
    NW: gl.constexpr = 16 if BITS % 2 == 1 else 8  # weight bundles per 4 blocks
    for rr in gl.static_range(CH):
        res = ()
        for j in gl.static_range(4):
            part = _zeros(NH, W, L3)
            w0 = ws[NW * (rr // SCALE_BLOCKS) + 2 * j]
            w1 = ws[NW * (rr // SCALE_BLOCKS) + 2 * j + 1]
            h0 = ws[NW * (rr // SCALE_BLOCKS) + (NW - 8) + 2 * j]  # K = 2, 4: unused
            h1 = ws[NW * (rr // SCALE_BLOCKS) + (NW - 8) + 2 * j + 1]
            if PAIR:
                w0, w1 = pair_columns(w0, w1)
            for v in gl.static_range(2):
                a = _lookup(w0, w1, h0, h1, lb, sel, rr % SCALE_BLOCKS, v, BITS, COPIES, PAIR)
                if TM == 8:
                    part = _mma(xs[rr], a, part, v, TM, False, IS_BF16)
                else:
                    part = _mma(xs[2 * rr + v], a, part, 0, TM, False, IS_BF16)
            sb = ss[2 * (rr // SCALE_BLOCKS) + j // 2]
            for h in gl.static_range(NH):
                res = res + (
                    _scale_fold(accs[NH * j + h], part[h], sb, j, rr % SCALE_BLOCKS, UE8M0),
                )
        accs = res
    return accs


@gluon.jit
def _gated_epilogue(
    accs, out_ptr, bias_ptr, row0, rows, N, stride_om, alpha, limit, W: gl.constexpr,
    WK: gl.constexpr, TM: gl.constexpr, LR: gl.constexpr, HAS_BIAS: gl.constexpr,
    ACT: gl.constexpr,
):  # fmt: skip
    """A gated pair's activation, computed once per output.  The weight's rows are interleaved
    (`fused.interleave_gate_up`, groups of `layout.GATED_GROUP`): columns 0..31 of 64-column
    block nb are gate columns 32 nb .. 32 nb + 31, columns 32..63 their up columns, i.e.
    accumulators j = 0, 1 (``accs[(TM // 8) j + h]``) and j = 2, 3 of the same lane.  Summed
    as `_sum_k_slices` does, in two halves; output column ``32 nb + i`` (of N / 2) is
    ``act(gate) * up``, gate and up rounded to the output dtype first as the GEMM's stored
    output would be (`fused.silu_and_mul`, `fused.swiglu_oai`)."""
    HALF: gl.constexpr = 2 * (TM // 8)
    WB: gl.constexpr = W // WK
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    gbuf = gl.allocate_shared_memory(gl.float32, [HALF * W, 32, 4], SL)
    ubuf = gl.allocate_shared_memory(gl.float32, [HALF * W, 32, 4], SL)
    for a in gl.static_range(HALF):
        gbuf.slice(a * W, W).store(accs[a])
        ubuf.slice(a * W, W).store(accs[HALF + a])
    gl.thread_barrier()
    L4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
    gate = gl.sum(gbuf._reinterpret(gl.float32, [HALF, WK, WB, 128], L4).load(LR), axis=1)
    up = gl.sum(ubuf._reinterpret(gl.float32, [HALF, WK, WB, 128], L4).load(LR), axis=1)

    # ng: the gate's weight column (its up column is ng + 32); n: the output column
    tok, ng = _reduced_tok_n(WB, TM, gl.SliceLayout(1, LR), 2)
    n = ng // 64 * 32 + ng % 64
    ok = (tok < rows) & (n < N // 2)
    dt: gl.constexpr = out_ptr.dtype.element_ty
    if HAS_BIAS:
        gate += gl.load(bias_ptr + ng, mask=ok, other=0.0).to(gl.float32)
        up += gl.load(bias_ptr + ng + 32, mask=ok, other=0.0).to(gl.float32)
    g = gate.to(dt).to(gl.float32)
    u = up.to(dt).to(gl.float32)
    if ACT == 1:
        y = (g / (1.0 + gl.exp(-g))).to(dt).to(gl.float32) * u
    else:
        g = gl.minimum(g, limit)
        u = gl.minimum(gl.maximum(u, -limit), limit)
        y = (u + 1.0) * (g / (1.0 + gl.exp(-g * alpha)))
    gl.store(out_ptr + (row0 + tok) * stride_om + n, y.to(dt), mask=ok)


@gluon.jit
def _tma_stage(
    it, w_desc, o_desc, s_desc, w_slot, o_slot, s_slot, bar, wrow, sp, n_iter,
    SPLIT: gl.constexpr, WK: gl.constexpr, BITS: gl.constexpr, S_TMA: gl.constexpr,
):  # fmt: skip
    """TMA copies of iteration ``it``'s weight words (if it exists) into the CTA's slots: per
    warp ``ks`` its quad ``(it SPLIT + sp) WK + ks`` (zeros past K) of 4 K words a row, as a
    [64 rows, MW] box of field words and at K = 3, 5 a [64, 4] box of 1-bit words (into
    `o_slot`); with ``S_TMA`` the quads' scale words, one [64 rows, WK] box (word ks = warp
    ks's quad) into `s_slot`; all landing on ``bar``."""
    MW: gl.constexpr = w_slot.shape[2]
    NBYTES: gl.constexpr = WK * 64 * 4 * BITS * 4 + (64 * WK * 4 if S_TMA else 0)
    ok = it < n_iter
    mbarrier.expect(bar, NBYTES, pred=ok)
    for ks in gl.static_range(WK):
        col = ((it * SPLIT + sp) * WK + ks) * (4 * BITS)
        tma.async_copy_global_to_shared(w_desc, [wrow, col], bar, w_slot.index(ks), pred=ok)
        if BITS % 2 == 1:
            tma.async_copy_global_to_shared(
                o_desc, [wrow, col + MW], bar, o_slot.index(ks), pred=ok
            )
    if S_TMA:
        tma.async_copy_global_to_shared(
            s_desc, [wrow, (it * SPLIT + sp) * WK], bar, s_slot, pred=ok
        )


@gluon.jit
def _slot_scales(s_slot, WK: gl.constexpr, L3: gl.constexpr):
    """The two scale bundles of `_load_scales` out of a [64 rows, WK words] slot: bundle h,
    register r3 of lane 4 g + c in warp ks is word ks of row 32 h + 16 (r3 // 2) + 8 (r3 % 2)
    + g (lanes c = 0..3 read one word, a broadcast)."""
    # the slot as [h, r3 // 2, r3 % 2, g, c (1), ks]
    rows = s_slot._reinterpret(
        gl.int32, [2, 2, 2, 8, 1, WK], gl.SwizzledSharedLayout(1, 1, 1, order=[5, 4, 3, 2, 1, 0])
    )
    L6: gl.constexpr = gl.BlockedLayout(
        [1, 1, 1, 1, 2, 2], [1, 1, 8, 4, 1, 1], [WK, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0]
    )
    ss = ()
    for h in gl.static_range(2):
        # [ks, h (1), g, c (1), r3 // 2, r3 % 2]
        b = rows.slice(h, 1, dim=0).permute([5, 0, 3, 4, 1, 2]).load(L6)
        b = gl.broadcast(b, gl.full([WK, 1, 8, 4, 2, 2], 0, gl.int32, L6))[0]
        ss = ss + (gl.convert_layout(gl.reshape(b, [WK, 32, 4]), L3),)
    return ss


@gluon.jit
def _pair_words(slot, jt: gl.constexpr, SHIFT: gl.constexpr, WK: gl.constexpr, L3: gl.constexpr):
    """Bundle ``jt`` of a slot whose rows hold one word per block for two lanes (K = 2, 3:
    [64 rows, 2 words j, 4 blocks]) or four (the 1-bit words: [64, 1, 4]): lanes ``4 g + 2 j +
    h`` read word j of row 8 jt + g (a broadcast read), shifted right by SHIFT x h (K = 3's
    field word: 16) or SHIFT x (2 j + h) (the 1-bit word: 8), as `_load_weights` shifts."""
    J: gl.constexpr = slot.shape[2] // 4
    words = slot._reinterpret(
        gl.int32, [WK, 8, 8, J, 1, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[5, 4, 3, 2, 1, 0])
    )
    L6: gl.constexpr = gl.BlockedLayout(
        [1, 1, 1, 1, 1, 4], [1, 1, 8, 2, 2, 1], [WK, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0]
    )
    b = words.slice(jt, 1, dim=1).load(L6)
    b = gl.broadcast(b, gl.full([WK, 1, 8, 2, 2, 4], 0, gl.int32, L6))[0]
    if SHIFT != 0:
        c = lane_in_quad(L6)
        if J == 2:
            b = b >> (SHIFT * (c % 2))
        else:
            b = b >> (SHIFT * c)
    return gl.convert_layout(gl.reshape(b, [WK, 32, 4]), L3)


@gluon.jit
def _tma_words(
    it, w_desc, o_desc, s_desc, w_slot, o_slot, s_slot, bar, wrow, sp, n_iter,
    L3: gl.constexpr, SPLIT: gl.constexpr, WK: gl.constexpr, BITS: gl.constexpr,
    S_TMA: gl.constexpr,
):  # fmt: skip
    """Iteration ``it``'s weight bundles (as `_load_weights` returns them for one quad) and,
    with ``S_TMA``, its scale bundles (else ``()``) out of the slots once their copies have
    landed; the slots are then refilled with iteration it + 1, whose copies run during this
    iteration's math."""
    MW: gl.constexpr = w_slot.shape[2]
    mbarrier.wait(bar, it & 1)
    ws = ()
    if MW == 16:
        # the slot as [warp, bundle jt, lane 4 g + c, block r]: row 8 jt + g, word c of box ks
        words = w_slot._reinterpret(
            gl.int32, [WK, 8, 32, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
        )
        L4: gl.constexpr = gl.BlockedLayout(
            [1, 1, 1, 4], [1, 1, 32, 1], [WK, 1, 1, 1], [3, 2, 1, 0]
        )
        for jt in gl.static_range(8):
            b = words.slice(jt, 1, dim=1).load(L4)
            ws = ws + (gl.convert_layout(gl.reshape(b, [WK, 32, 4]), L3),)
    else:  # K = 2, 3: lanes 2 j, 2 j + 1 read 2-bit word j (K = 3: each its half)
        for jt in gl.static_range(8):
            ws = ws + (_pair_words(w_slot, jt, 16 if BITS == 3 else 0, WK, L3),)
    if BITS % 2 == 1:  # the 1-bit words' bundles, lane c's byte c at bit 0
        for jt in gl.static_range(8):
            ws = ws + (_pair_words(o_slot, jt, 8, WK, L3),)
    ss = ()
    if S_TMA:
        ss = _slot_scales(s_slot, WK, L3)
    gl.thread_barrier()  # every warp holds its words: the slots may be refilled
    _tma_stage(
        it + 1, w_desc, o_desc, s_desc, w_slot, o_slot, s_slot, bar, wrow, sp, n_iter, SPLIT,
        WK, BITS, S_TMA,
    )  # fmt: skip
    return ws, ss


@gluon.jit
def _load_scales(s_ptr, bq, s_off, nb_ok, KBP, KBS, MASK: gl.constexpr):
    """The scale bundles of the quad from block ``bq`` (per 4 blocks: j < 2, j >= 2)."""
    ok = nb_ok & (bq < KBP) if MASK else nb_ok
    ss = ()
    for h in gl.static_range(2):
        col = 32 * h * KBS
        ss = ss + (gl.load(s_ptr + s_off + (col + bq // SCALE_BLOCKS), mask=ok, other=0),)
    return ss


@gluon.jit
def kbit_mma_kernel(
    x_ptr,  # int32 view of x [M, K/2] (pairs of activations)
    q_ptr,  # int32 [(E,) N_pad, KBP * BITS] (field-packed)
    s_ptr,  # int32 view of the block scales [(E,) N_pad, 4 KBS]
    lut_ptr,  # int32 [NE, EW]: per index, the registers its levels make (in x's dtype)
    bias_ptr,  # [(E,) N]
    out_ptr,  # [M or rows, N], x's dtype
    ws_ptr,  # fp32 [>= token tiles * TM * N_pad] zeros (split-K only)
    cnt_ptr,  # int32 [>= grid(0) * grid(1)] zeros (split-K only)
    block_expert_ptr,  # GROUPED: int32 [token tiles], the tile's expert (E: none, exit)
    block_row_ptr,  # GROUPED: int32 [token tiles], the tile's first sorted row
    m_indptr_ptr,  # GROUPED: [E + 1], expert e's sorted rows m_indptr[e] .. m_indptr[e + 1]
    gather_ptr,  # GATHER: [rows], the x row of each sorted row
    M,
    N,  # true output features (stores are masked to them)
    K2,  # true input features / 2 (x pairs)
    NB,  # N_pad / 64
    KBP,  # blocks of 32 per weight row (a multiple of 4)
    KBS,  # int32 scale words per row (4 blocks each)
    n_iter,  # chunks per CTA
    num_experts,
    stride_xm,  # in int32 units
    stride_om,
    stride_qe,  # GROUPED: per expert, in int32 units (q, s) and elements (bias)
    stride_se,
    stride_be,
    act_alpha,  # ACT == 2: GPT-OSS's SwiGLU alpha and clamp limit
    act_limit,
    w_desc,  # TMA: descriptor of qweight as [(E *) N_pad, KBP * BITS] int32, box [64, 16 or 8]
    o_desc,  # TMA at K = 3, 5: the same in boxes [64, 4] (the 1-bit words)
    s_desc,  # S_TMA: descriptor of the scales as int32 [(E *) N_pad, KBS], box [64, WK]
    W: gl.constexpr,  # warps per CTA, each on one 64-column block
    CH: gl.constexpr,  # blocks per chunk (a multiple of 4)
    TM: gl.constexpr,  # tokens per CTA tile: 8 or 16
    SPLIT: gl.constexpr,  # CTAs per output tile along K
    COPIES: gl.constexpr,  # copies of the table in shared memory (lane % COPIES reads its own)
    BITS: gl.constexpr,  # 2 or 4
    PIPE: gl.constexpr,  # prefetch the next chunk while computing this one
    MASK_N: gl.constexpr,  # NB is not a multiple of W // WK
    MASK_K: gl.constexpr,  # the chunks overrun KBP
    HAS_BIAS: gl.constexpr,
    IS_BF16: gl.constexpr,
    UE8M0: gl.constexpr = False,  # scales are UE8M0 (MXFP4), not E4M4
    GROUPED: gl.constexpr = False,  # token tiles are the row blocks of a grouped GEMM
    GATHER: gl.constexpr = False,
    PDL: gl.constexpr = False,  # programmatic dependent launch (`common.pdl`)
    WK: gl.constexpr = 1,  # warps per 64-column block, splitting its chunks (summed in the CTA)
    ACT: gl.constexpr = 0,  # a gated pair (`_gated_epilogue`): 1 SiLU-and-mul, 2 GPT-OSS SwiGLU
    LATE_RELEASE: gl.constexpr = False,  # PDL: let the next kernel launch once K is streamed
    TMA: gl.constexpr = False,  # weight words staged by TMA in a shared-memory slot
    S_TMA: gl.constexpr = False,  # with TMA, the scale words too (rows of 16-byte multiples)
    PAIR: gl.constexpr = False,  # K = 2: columns g and g + 8 share lookups (`pair_columns`)
):
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    EW: gl.constexpr = 2 if BITS == 2 else 1  # table words per entry
    NE: gl.constexpr = _table_entries(BITS)
    mt = gl.program_id(1)
    sp = gl.program_id(2)
    if not LATE_RELEASE:
        pdl.release(PDL)
    if GROUPED:  # the token tile is rows row0 .. of one expert (written by the sort kernels)
        mt += pdl.wait(PDL)
        expert = gl.load(block_expert_ptr + mt)
        if expert >= num_experts:
            return
        row0 = gl.load(block_row_ptr + mt)
        rows = gl.load(m_indptr_ptr + expert + 1).to(gl.int32) - row0
        e = expert.to(gl.int64)
        q_ptr = q_ptr + e * stride_qe
        s_ptr = s_ptr + e * stride_se
        bias_ptr = bias_ptr + e * stride_be
    else:
        row0 = mt * TM
        rows = M - row0

    WB: gl.constexpr = W // WK  # column blocks per CTA
    nb, l3, r3, g, c, w3 = _tile_coords(W, WB, L3)
    # the warp's first chunk: chunk (it * SPLIT + sp) * WK + its k slice at iteration it
    b0 = (sp * WK + w3 // WB) * CH
    if MASK_N:
        nb_ok = nb < NB
    else:
        nb_ok = nb >= 0
    # the lane's table base (bytes, in the shared window) and K = 2 byte selectors per step
    lb0 = (l3 % COPIES) * (4 * EW) + 0 * r3
    lb = gl.inline_asm_elementwise(_BASE_ASM, "=r,r", [lb0], dtype=gl.int32, is_pure=True, pack=1)
    sel = 0x4440 + 2 * (c % 2) + r3 % 2
    if BITS >= 4:
        word = c
    else:
        word = c // 2
    # weight bundle (j, t): column 64 nb + 16 j + 8 t + g, register r3 = block r3 of the 4
    # (its word `word`: quad-interleaved, the 4 are contiguous);
    # scale bundle h: column 64 nb + 32 h + 16 (r3 // 2) + 8 (r3 % 2) + g (j = 2h + r3 // 2)
    q_off = (nb * 64 + g) * (KBP * BITS) + 4 * word + r3
    h_off = (nb * 64 + g) * (KBP * BITS) + 4 * (BITS - 1) + r3  # K = 3, 5: the 1-bit word
    s_off = (nb * 64 + 16 * (r3 // 2) + 8 * (r3 % 2) + g) * KBS
    # x: TM = 8: token g, pairs 4c + r3 of the block; TM = 16: token g + 8 (r3 // 2), pairs
    # 4c + 2v + r3 % 2.  Tokens past the tile's rows read its last row (never stored).
    if TM == 8:
        xt = g + 0 * r3
        x_pair = 4 * c + r3
    else:
        xt = g + 8 * (r3 // 2)
        x_pair = 4 * c + r3 % 2
    xm = row0 + gl.minimum(xt, rows - 1)
    if GATHER:
        xm = gl.load(gather_ptr + xm).to(gl.int32)
    x_off = xm * stride_xm + x_pair

    # the table, COPIES times: word (e COPIES + copy) EW + i = lut[e, i]; consecutive lanes
    # store consecutive copies (no bank conflicts). With WK > 1 the warps' partial sums reuse
    # its bytes after the loop (`_sum_k_slices`): zero rows pad it to their size, so that the
    # table stays the largest allocation and starts at global_smem (the TMA slot is smaller).
    SUMS: gl.constexpr = 4 * (TM // 8) * W * 128 // (COPIES * EW) if WK > 1 else 0
    # (and with TMA, to more than the slots' bytes: K = 3's 64 entries)
    SLOTS: gl.constexpr = _pow2_at_least(WK * 64 * 4 * BITS // (COPIES * EW) + 1) if TMA else 0
    ROWS: gl.constexpr = _pow2_at_least(max(NE, SUMS, SLOTS))
    # the first chunk's loads go out before the table is built; with PDL x waits for the
    # previous kernel to finish, after the table
    if TMA:  # one slot of WK boxes: an iteration's words, copied during the previous one's math
        gl.static_assert(CH == 4 and WK == W, "TMA staging: CH 4, WK = W")
        gl.static_assert(
            WK * 64 * 4 * BITS * 4 < ROWS * COPIES * EW * 4, "TMA slots must be below the table"
        )
        MW: gl.constexpr = w_desc.block_shape[1]  # field words of a quad row (the host's box)
        w_slot = gl.allocate_shared_memory(gl.int32, [WK, 64, MW], w_desc.layout)
        if BITS % 2 == 1:
            o_slot = gl.allocate_shared_memory(gl.int32, [WK, 64, 4], o_desc.layout)
        else:
            o_slot = w_slot
        if S_TMA:
            s_slot = gl.allocate_shared_memory(gl.int32, [64, WK], s_desc.layout)
        else:
            s_slot = w_slot
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        wrow = gl.program_id(0) * 64
        if GROUPED:
            wrow = expert * (NB * 64) + wrow
        _tma_stage(
            0, w_desc, o_desc, s_desc, w_slot, o_slot, s_slot, bar, wrow, sp, n_iter, SPLIT,
            WK, BITS, S_TMA,
        )  # fmt: skip
        if not S_TMA:
            ss = _load_scales(s_ptr, b0, s_off, nb_ok, KBP, KBS, MASK_K)
    else:
        ws, ss = _load_weights(
            q_ptr, s_ptr, b0, q_off, h_off, c, s_off, nb_ok, KBP, KBS, CH, BITS, MASK_K
        )
    if not PDL:
        xs = _load_x(x_ptr, b0, x_off, x_pair, K2, CH, TM)
    LF: gl.constexpr = gl.BlockedLayout([1, 1, EW], [32 // COPIES, COPIES, 1], [W, 1, 1], [2, 1, 0])
    le = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(1, LF)))
    li = gl.arange(0, EW, layout=gl.SliceLayout(0, gl.SliceLayout(1, LF)))
    lut_at = gl.expand_dims(le, 1) * EW + gl.expand_dims(li, 0)
    if ROWS == NE:
        lut2 = gl.load(lut_ptr + lut_at)
    else:
        lut2 = gl.load(lut_ptr + lut_at, mask=lut_at < NE * EW, other=0)
    lut3 = gl.expand_dims(lut2, 1) + gl.zeros([ROWS, COPIES, EW], gl.int32, LF)
    table = gl.allocate_shared_memory(
        gl.int32, [ROWS, COPIES, EW], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    )
    table.store(lut3)
    gl.thread_barrier()
    if PDL:
        if not GROUPED:
            x_off += pdl.wait(PDL)
        xs = _load_x(x_ptr, b0, x_off, x_pair, K2, CH, TM)

    accs = _zeros(4 * (TM // 8), W, L3)
    for it in range(n_iter - 1):  # the last chunk after the loop: no loads past the plan
        b_next = b0 + (it + 1) * SPLIT * WK * CH
        if TMA:
            ws, sst = _tma_words(
                it, w_desc, o_desc, s_desc, w_slot, o_slot, s_slot, bar, wrow, sp, n_iter, L3,
                SPLIT, WK, BITS, S_TMA,
            )  # fmt: skip
            if S_TMA:
                ss = sst
            accs = _chunk(
                ws, xs, ss, accs, lb, sel, W, L3, CH, TM, BITS, COPIES, IS_BF16, UE8M0, PAIR
            )
            if not S_TMA:
                ss = _load_scales(s_ptr, b_next, s_off, nb_ok, KBP, KBS, MASK_K)
            xs = _load_x(x_ptr, b_next, x_off, x_pair, K2, CH, TM)
        elif PIPE:  # the next chunk's loads before this chunk's math
            nws, nxs, nss = _load_chunk(
                q_ptr, x_ptr, s_ptr, b_next, q_off, h_off, c, x_off, x_pair, s_off, nb_ok,
                KBP, KBS, K2, CH, TM, BITS, MASK_K,
            )  # fmt: skip
            accs = _chunk(
                ws, xs, ss, accs, lb, sel, W, L3, CH, TM, BITS, COPIES, IS_BF16, UE8M0, PAIR
            )
            ws = nws
            xs = nxs
            ss = nss
        else:
            accs = _chunk(
                ws, xs, ss, accs, lb, sel, W, L3, CH, TM, BITS, COPIES, IS_BF16, UE8M0, PAIR
            )
            ws, xs, ss = _load_chunk(
                q_ptr, x_ptr, s_ptr, b_next, q_off, h_off, c, x_off, x_pair, s_off, nb_ok,
                KBP, KBS, K2, CH, TM, BITS, MASK_K,
            )  # fmt: skip
    if TMA:
        ws, sst = _tma_words(
            n_iter - 1, w_desc, o_desc, s_desc, w_slot, o_slot, s_slot, bar, wrow, sp, n_iter,
            L3, SPLIT, WK, BITS, S_TMA,
        )  # fmt: skip
        if S_TMA:
            ss = sst
        mbarrier.invalidate(bar)  # its bytes may be reused by the sums below
    accs = _chunk(ws, xs, ss, accs, lb, sel, W, L3, CH, TM, BITS, COPIES, IS_BF16, UE8M0, PAIR)
    if LATE_RELEASE:
        pdl.release(PDL)

    tok, n = fragment_tok_n(c, g, r3, nb)
    if WK > 1:  # the WK warps of a block summed different chunks: add them up (`_sum_k_slices`)
        gl.thread_barrier()  # every warp's last lookup is done before shared memory is reused
        WE: gl.constexpr = 4 if W >= 4 else W
        LR: gl.constexpr = gl.BlockedLayout(
            [1, WK, 1, 1], [1, 1, 1, 32], [W // WE, 1, 1, WE], [3, 2, 1, 0]
        )
        if ACT != 0:
            gl.static_assert(SPLIT == 1, "a gated epilogue needs the whole K in the CTA")
            _gated_epilogue(
                accs, out_ptr, bias_ptr, row0, rows, N, stride_om, act_alpha, act_limit, W, WK,
                TM, LR, HAS_BIAS, ACT,
            )  # fmt: skip
            return
        accs = (_sum_k_slices(accs, W, WK, TM, LR),)
        tok, n = _reduced_tok_n(WB, TM, gl.SliceLayout(1, LR))
    else:
        gl.static_assert(ACT == 0, "a gated epilogue needs the in-CTA split (WK > 1)")
    epilogue_rows(
        accs, out_ptr, ws_ptr, cnt_ptr, bias_ptr, mt, row0, rows, tok, n, N, NB, stride_om,
        TM, SPLIT, HAS_BIAS, WK == 1,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# host side


def _entry_indices(bits: int, device) -> torch.Tensor:
    """int64 ``[entries, elements]``: the codebook index of each element an entry decodes
    (lowest first), as `_lookup_asm` builds the entry number."""
    e = torch.arange(_table_entries(bits), device=device)[:, None]
    if bits in (2, 4):  # a byte of 8 / bits fields
        return (e >> (bits * torch.arange(8 // bits, device=device))) & ((1 << bits) - 1)
    f = bits - 1  # two f-bit fields, then their two 1-bit fields at bits 2f, 2f + 1
    two = torch.arange(2, device=device)
    return ((e >> (f * two)) & ((1 << f) - 1)) | (((e >> (2 * f + two)) & 1) << f)


def lookup_table(
    codebook: torch.Tensor, bits: int, dtype: torch.dtype, factor: float = 16.0
) -> torch.Tensor:
    """int32 ``[entries, words]``: for each table entry (a byte of fields at K = 2, 4; two
    elements' fields with their 1-bit fields at K = 3, 5), the mma registers its levels make,
    as ``factor * codebook[index]`` in `dtype` (low half = the lower element; 16 undoes the
    E4M4 scale's ``absmax / 16``, UE8M0 scales take 1).  Entries 256 / 64 / 256 / 1024 and
    words 2 / 1 / 1 / 1 for K = 2 / 3 / 4 / 5."""
    if bits not in MMA_BITS:
        raise ValueError(f"kbit mma kernel: bits must be one of {MMA_BITS}, got {bits}")
    fields = _entry_indices(bits, codebook.device)
    half = (factor * codebook.to(torch.float32)[fields]).to(dtype).view(torch.int16)
    half = half.to(torch.int64) & 0xFFFF
    return _as_int32(half[:, 0::2] | (half[:, 1::2] << 16)).contiguous()


def _check_options(bits: int, chunk: int, copies: int) -> None:
    if bits not in MMA_BITS:
        raise ValueError(f"kbit mma kernel: bits must be one of {MMA_BITS}, got {bits}")
    if chunk % SCALE_BLOCKS.value or chunk <= 0:
        raise ValueError(f"kbit mma kernel: chunk={chunk} blocks must be a multiple of 4")
    if copies not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"kbit mma kernel: copies={copies} must be a power of two <= 32")


def plan(
    blocks: int,
    kbp: int,
    token_tiles: int,
    sms: int,
    warps: int,
    wk: int,
    chunk: int,
    ctas_per_sm: int,
) -> tuple[int, int, int]:
    """(column blocks per CTA, CTAs per tile along K, chunks per warp) for ``blocks`` 64-column
    blocks of ``kbp`` 32-blocks along K: a CTA's ``warps`` cover ``warps // wk`` blocks, ``wk``
    warps a block; warp ``ks`` of CTA ``sp`` takes chunks ``(it * split + sp) * wk + ks``, and
    the split fills ``ctas_per_sm * sms`` CTAs for ``token_tiles`` tiles."""
    if wk not in (1, 2, 4, 8) or warps % wk:
        raise ValueError(f"kbit mma kernel: wk={wk} must divide warps={warps}")
    wb = warps // wk
    tiles = triton.cdiv(blocks, wb) * token_tiles
    steps = triton.cdiv(triton.cdiv(kbp, chunk), wk)  # rounds of wk chunks
    split, n_iter = splitk.split_plan(steps, tiles, sms, ctas_per_sm)
    return wb, split, n_iter


def tma_staging(
    device: torch.device, bits: int, tm: int, warps: int, wk: int, chunk: int, copies: int
) -> bool:
    """Whether a launch stages its weight words by TMA (`_tma_words`): on sm_90+ one-quad
    chunks with every warp on one column block, 8-token tiles (measured faster at one token,
    not for 16-token tiles at 2 CTAs an SM: benchmarks/kbit-lab-log.md §19, §23, §24; those
    are staged where `staged_tile16` plans them for 3); at K = 2, 4 (and
    MXFP4) where the table is larger than the slot (K = 4: 32 copies against 16 KB; K = 2: 16
    copies of two-word entries against 8 KB), so that it stays at the start of shared memory;
    at K = 5 always; not at K = 3 (2.7% slower end to end; the kernel can stage it, padding
    its 64-entry table past the slots)."""
    if device.type != "cuda" or cuda_capability(device) < (9, 0):
        return False
    if tm != 8 or chunk != 4 or wk != warps or bits == 3:
        return False
    if bits == 5:
        return True
    entry_bytes = 8 if bits == 2 else 4
    return _table_entries(bits) * copies * entry_bytes > wk * 64 * 4 * bits * 4


#: CTAs per SM that a one-quad, 4-warp CTA fits by its registers: 16-token tiles (about 206
#: registers), and 16-token tiles capped at `TILE16_STAGED_MAXNREG` (K = 2, 4: 32-56 bytes of
#: spills, a few reloads in the loop; 8-token tiles take about 167 and fit 3 uncapped)
TILE16_CTAS_PER_SM = 2
TILE16_STAGED_CTAS_PER_SM = 3
TILE16_STAGED_MAXNREG = 168
#: bit widths whose 9-16-token launches may run one staged 16-token tile (`staged_tile16`):
#: not K = 3 (its tiles are not staged) nor K = 5 (its 16-token tile takes 255 registers)
STAGED_TILE16_BITS = (2, 4)


#: token tiles in which K = 2's lookups serve columns g and g + 8 together (`pair_columns`):
#: 16-token tiles (a chunk's loop 921 -> 754 instructions staged, benchmarks/kbit-lab-log.md
#: §34); at one token the same lost 4% end to end (§25)
PAIRED_TILES = (16,)


def pairs_columns(bits: int, tm: int) -> bool:
    """Whether a launch of ``tm``-token tiles at K = ``bits`` pairs columns (`pair_columns`)."""
    return bits == 2 and tm in PAIRED_TILES


def _wave_fill(
    blocks: int, kbp: int, token_tiles: int, sms: int, warps: int, wk: int, chunk: int, per_sm: int
) -> float:
    """The share of its waves' CTA slots that a launch planned by `plan` fills."""
    wb, split, _ = plan(blocks, kbp, token_tiles, sms, warps, wk, chunk, per_sm)
    ctas = triton.cdiv(blocks, wb) * token_tiles * split
    slots = per_sm * sms
    return ctas / (triton.cdiv(ctas, slots) * slots)


def staged_tile16(
    M: int, blocks: int, kbp: int, sms: int, tma: bool, warps: int, wk: int, chunk: int
) -> bool:
    """Whether a dense launch of M tokens over ``blocks`` 64-column blocks and ``kbp`` blocks
    of 32 along K runs its 16-token tile TMA-staged, capped at `TILE16_STAGED_MAXNREG`
    registers and planned for `TILE16_STAGED_CTAS_PER_SM` CTAs an SM: at 9-16 tokens where the
    launch can be staged (``tma``: `tma_staging` of its 8-token tile) and that plan fills the
    GPU's CTA slots better than the unstaged tile's 2 an SM (Qwen3-8B's qkv and gate_up, 1.05x
    and 1.26-1.39x faster on an H100; on o and down the 3-an-SM plan was 0.83-0.92x:
    benchmarks/kbit-lab-log.md §33)."""
    if not 8 < M <= 16 or not tma:
        return False
    staged = _wave_fill(blocks, kbp, 1, sms, warps, wk, chunk, TILE16_STAGED_CTAS_PER_SM)
    one = _wave_fill(blocks, kbp, 1, sms, warps, wk, chunk, TILE16_CTAS_PER_SM)
    return staged > one + 0.1


def scales_by_tma(scales_int32: torch.Tensor, wk: int) -> bool:
    """Whether a TMA-staged launch copies its scale words by TMA too: a box row of ``wk``
    words must be 16 bytes or more, and the rows (and the base) 16-byte aligned, i.e. K padded
    to a multiple of 512."""
    return (
        wk * 4 >= 16
        and scales_int32.shape[-1] % 4 == 0
        and scales_int32.is_contiguous()
        and scales_int32.data_ptr() % 16 == 0
    )


def _launch(
    x2, qweight, scales, lut, rows, N, bits, bias, tm, token_tiles, *, group=None, ue8m0=False,
    planned_tiles=None, warps=4, chunk=4, ctas_per_sm=4, copies=1, pipe=False, maxnreg=None,
    wk=None, act=None, stage_by_tma=None, stage_scales=None, owner=None,
):  # fmt: skip
    """One launch of `kbit_mma_kernel` over ``token_tiles`` tiles of ``tm`` tokens, into a new
    output of ``rows`` rows in x's dtype (the split
    along K planned for ``planned_tiles`` of them, default all); ``group``: (block_expert,
    block_row, m_indptr, gather or None) of a grouped GEMM over the leading (expert) dim of
    qweight / scales / bias; ``wk``: warps per 64-column block, splitting its chunks (None: all
    of the CTA's, so the CTA covers one block and a split across CTAs is ``wk`` times smaller
    or gone; faster on every measured shape, benchmarks/kbit-lab-log.md §13).

    ``act``: (`fused.GatedAct`, interleave) for a gated pair whose rows are interleaved in
    groups of ``interleave`` (`fused.interleave_gate_up`): returns ``act`` of the output, [rows,
    N / 2], computed in the epilogue where the CTA holds a block's whole K (``interleave`` 32,
    ``wk`` > 1, no split across CTAs, ``bits`` not in `SEPARATE_ACT_BITS`), else by the
    separate kernel. With PDL, a fused dense launch of more CTAs than one wave
    (``ctas_per_sm`` per SM) lets the next kernel launch only once each CTA has streamed its K:
    launched earlier, the next GEMM's CTAs slowed the last wave (benchmarks/kbit-lab-log.md
    §16; grouped MXFP4 launches keep the early release, not measured).

    ``stage_by_tma``: the weight words come through a TMA-filled shared-memory slot instead of
    register loads (None: `tma_staging` decides); ``stage_scales``: with it, the scale words
    too (None: dense launches where `scales_by_tma` allows, 1.08-1.13x on the one-token K = 4
    GEMMs; grouped launches load them, 0.87x staged on MXFP4 experts: kbit-lab-log §26);
    ``owner``: the object holding qweight, which keeps its TMA descriptors
    (`common.tma.words_descriptor`)."""
    _check_options(bits, chunk, copies)
    K = x2.shape[1]
    n_pad, kbp = qweight.shape[-2], qweight.shape[-1] // bits
    NB = n_pad // 64
    wk = warps if wk is None else wk
    planned = max(1, planned_tiles or token_tiles)
    sms = splitk.num_sms(x2.device)
    wb, split, n_iter = plan(NB, kbp, planned, sms, warps, wk, chunk, ctas_per_sm)
    tiles = triton.cdiv(NB, wb) * token_tiles
    grid = (triton.cdiv(NB, wb), token_tiles, split)
    fn, interleave = act if act is not None else (None, 0)
    fuse = fn is not None and interleave == GATED_GROUP and wk > 1 and split == 1
    fuse = fuse and bits not in SEPARATE_ACT_BITS
    out = torch.empty(rows, N // 2 if fuse else N, device=x2.device, dtype=x2.dtype)
    ws, cnt = _workspace(x2.device, token_tiles * tm * n_pad if split > 1 else 1, tiles)
    grouped = group is not None
    block_expert, block_row, m_indptr, gather = group if grouped else (out, out, out, None)
    has_bias = bias is not None
    sw = scales.view(torch.int32)
    if stage_by_tma is None:
        stage_by_tma = tma_staging(x2.device, bits, tm, warps, wk, chunk, copies)
    w_desc = o_desc = s_desc = None
    if stage_scales is None:
        stage_scales = stage_by_tma and not grouped and scales_by_tma(sw, wk)
    elif stage_scales and not (stage_by_tma and scales_by_tma(sw, wk)):
        raise ValueError(
            f"kbit mma kernel: scale words {tuple(sw.shape)} (int32) with wk={wk} cannot be "
            f"staged by TMA (weights staged: {stage_by_tma}): it needs the weights' staging, "
            "rows of a multiple of 4 words (K padded to 512) and wk >= 4"
        )
    if stage_by_tma:  # a warp's boxes: 64 rows of a quad's field words, and 1-bit words
        words = qweight.view(-1, qweight.shape[-1])
        w_desc = words_descriptor(words, [64, 16 if bits >= 4 else 8], owner)
        o_desc = words_descriptor(words, [64, 4], owner) if bits % 2 else w_desc
    if stage_scales:  # the CTA's box: 64 rows of its warps' quads' scale words
        s_desc = words_descriptor(sw.view(-1, sw.shape[-1]), [64, wk], owner)
    kbit_mma_kernel[grid](
        x2.view(torch.int32), qweight, sw, lut, bias if has_bias else out, out, ws, cnt,
        block_expert, block_row, m_indptr, gather if gather is not None else out,
        x2.shape[0], N, K // 2, NB, kbp, sw.shape[-1], n_iter,
        qweight.shape[0] if grouped else 1, x2.stride(0) // 2, out.stride(0),
        qweight.stride(0) if grouped else 0, sw.stride(0) if grouped else 0,
        bias.stride(0) if grouped and has_bias else 0,
        fn.alpha if fuse else 1.0, fn.clamp if fuse else 0.0, w_desc, o_desc, s_desc,
        W=warps, CH=chunk, TM=tm, SPLIT=split, COPIES=copies, BITS=bits, PIPE=pipe,
        MASK_N=NB % wb != 0, MASK_K=split * n_iter * wk * chunk != kbp, WK=wk,
        HAS_BIAS=has_bias, IS_BF16=x2.dtype == torch.bfloat16, UE8M0=ue8m0,
        GROUPED=grouped, GATHER=gather is not None,
        ACT=_ACT_CODES[fn.kind] if fuse else 0, num_warps=warps, TMA=stage_by_tma,
        S_TMA=stage_scales, PAIR=pairs_columns(bits, tm),
        LATE_RELEASE=fuse and not grouped and tiles > ctas_per_sm * sms,
        **pdl.launch_options(pdl.enabled(x2.device)),
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )  # fmt: skip
    if fn is not None and not fuse:
        return fn(out, interleave)
    return out


def kbit_mma_matmul(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    lut: torch.Tensor,
    N: int,
    bits: int,
    bias: torch.Tensor | None = None,
    warps: int = 4,
    chunk: int = 4,
    ctas_per_sm: int = 4,
    copies: int = 1,
    pipe: bool = False,
    maxnreg: int | None = None,
    wk: int | None = None,
    act: tuple[GatedAct, int] | None = None,
    stage_by_tma: bool | None = None,
    stage_scales: bool | None = None,
    owner: object | None = None,
) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W.T (+ bias) for a field-packed weight (``qweight``, ``scales``
    of `layout.KbitWeight`) and its `lookup_table` ``lut`` in x's dtype; x2 fp16/bf16 on CUDA.

    ``chunk`` blocks of 32 per K step (a multiple of 4), ``copies`` of the table in shared
    memory (1..32, a power of two), ``warps`` 64-column blocks per CTA, ``maxnreg`` a cap on
    registers per thread (None: the compiler's choice), ``wk`` warps per 64-column block
    splitting its chunks (None: all ``warps``; see `_launch`); ``act``: a gated pair's
    activation, out [M, N / 2] (see `_launch`); ``stage_by_tma``, ``stage_scales``,
    ``owner``: see `_launch`. Tokens go in 8-token tiles up to 8, beyond in 16-token tiles,
    at 9-16 tokens staged where `staged_tile16` picks it (then planned for
    `TILE16_STAGED_CTAS_PER_SM` and capped at ``maxnreg`` or `TILE16_STAGED_MAXNREG`)."""
    x2 = as_int32_pairs(x2)
    M = x2.shape[0]
    tm = 8 if M <= 8 else 16
    if 8 < M <= 16 and bits in STAGED_TILE16_BITS:
        wk_all = warps if wk is None else wk
        tma = stage_by_tma
        if tma is None:
            tma = tma_staging(x2.device, bits, 8, warps, wk_all, chunk, copies)
        blocks, kbp = qweight.shape[-2] // 64, qweight.shape[-1] // bits
        sms = splitk.num_sms(x2.device)
        if staged_tile16(M, blocks, kbp, sms, tma, warps, wk_all, chunk):
            ctas_per_sm = TILE16_STAGED_CTAS_PER_SM
            stage_by_tma = True
            maxnreg = TILE16_STAGED_MAXNREG if maxnreg is None else maxnreg
    return _launch(
        x2, qweight, scales, lut, M, N, bits, bias, tm, triton.cdiv(M, tm), warps=warps,
        chunk=chunk, ctas_per_sm=ctas_per_sm, copies=copies, pipe=pipe, maxnreg=maxnreg, wk=wk,
        act=act, stage_by_tma=stage_by_tma, stage_scales=stage_scales, owner=owner,
    )  # fmt: skip


def grouped_lut_mma(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    lut: torch.Tensor,
    N: int,
    plan: BlockPlan,
    *,
    gather: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ue8m0: bool = False,
    **config,
) -> torch.Tensor:
    """Grouped GEMM of 4-bit codebook weights: ``out [plan.num_rows, N]``, row r of expert e
    ``x[gather[r] if gather is not None else r] @ W[e].T (+ bias[e])`` for ``qweight`` int32
    ``[E, N_pad, KBP * 4]``, ``scales`` uint8 ``[E, N_pad, 4 KBS]`` (E4M4, or UE8M0 with
    `ue8m0`), the plan's row blocks of ``plan.block_m`` (8 or 16) tokens, the split along K
    planned for the fewest real blocks (``plan.min_blocks``); `config`: the options of
    `kbit_mma_matmul`."""
    if plan.block_m not in (8, 16):
        raise ValueError(f"grouped_lut_mma: row blocks of 8 or 16, got {plan.block_m}")
    x = as_int32_pairs(x)
    if plan.num_rows == 0 or plan.num_blocks == 0:
        width = N if config.get("act") is None else N // 2
        return torch.empty(plan.num_rows, width, device=x.device, dtype=x.dtype)
    group = (plan.block_expert, plan.block_row, plan.m_indptr, gather)
    return _launch(
        x, qweight, scales, lut, plan.num_rows, N, 4, bias, plan.block_m, plan.num_blocks,
        group=group, ue8m0=ue8m0, planned_tiles=plan.min_blocks, **config,
    )  # fmt: skip
