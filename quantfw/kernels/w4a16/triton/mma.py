"""Gluon kernel for W4A16 at small M: dequantize in registers straight into mma fragments.

Layout (built once by ``pack_mma`` / ``pack_mma_scales`` in quantfw/kernels/w4a16/layout.py; docs/kernels-w4a16.md):

* ``qf`` int32 ``[N/64, K/16, 32, 4]``: the 32-bit word ``j`` of lane ``l = 4*g + c`` in block
  ``(nb, kb)`` holds, for ``n0 = 64*nb + 16*j + g`` and ``n1 = n0 + 8``, the 8 values an
  ``mma.m16n8k16`` fragment needs from that lane for the columns ``n0``, ``n1``:
  nibble ``s`` (bits ``4s``) = ``q[16*kb + 8*e + 2*c + h, n0 + 8*t]`` with ``s = 4h + 2t + e``.
  So ``lop3(w >> 4p, 0x000F000F, magic)`` (p = 0..3) is register ``e = p % 2`` of tile ``t = p // 2``.
* ``sz`` int32 ``[n_groups, N/64, 8, 8]``: ``[grp, nb, g, 2*j + t]`` = scale (low half) and
  ``magic + zero`` (high half) of column ``n0 + 8t`` in the activation dtype.

The mma runs transposed ("swap AB"): the dequantized weights are the A operand (16 output
columns x k16; a word's 4 registers p = 0..3 are A registers (a0, a2, a1, a3)) and x is the B
operand (k16 x 8 tokens), so a token tile is TM = 8 (one mma per word, M <= 8) or 16 (two).
Each lane loads its 4 words of a k16 step with one 128-bit load and its x fragment with 32-bit
loads (rows past M re-read row M - 1; those outputs are never stored).  Per word: 3 shifts and
4 ``lop3`` give ``magic + q`` pairs, then either

* ``fold`` (the default): one mma of ``magic + q`` against x into a per-group fp32 sum; at the
  end of each group (or chunk) ``acc += s * (gsum - (magic + z) * xsum)``, where ``xsum`` (the
  per-token sum of x over the same k) comes from one extra mma with an all-ones A.  Exact
  integer weights in the mma, scale and zero once per group: 8 instructions per word and k16
  step instead of 16 (SASS, sm_90, TM = 8: 50 against 77 per warp and k16 step, loads
  included); or
* per element: ``sub`` of ``magic + z`` and ``mul`` by ``s`` on x2 vectors, then the mma.

Each warp owns one 64-column block and one token tile; CTAs of a split-K grid add into an fp32
workspace and the last one to arrive (a counter per CTA tile) writes the result and zeroes the
workspace and its counter, so one launch does the whole matmul and the buffers are clean for
the next call (or graph replay).

The Gluon layouts are explicit: ``L3`` gives every thread 4 consecutive elements ("a bundle")
of a ``[W, 32, 4]`` tensor (warp, lane, register), so the inline PTX sees the registers it
expects.  A wrong assumption here gives wrong numbers, which the GPU tests check.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

from quantfw.kernels.common import pdl, splitk

FP16_MAGIC = 0x64006400  # fp16 1024.0 in both halves: (magic | q) = 1024 + q
BF16_MAGIC = 0x43004300  # bf16 128.0


@constexpr_function
def _deq_asm(j: int, is_bf16: bool) -> str:
    """PTX for word ``j`` of the weight bundle ($4..$7) with its scale/zero bundle ($8..$11).

    Outputs $0..$3: register p = (k 2c + 8 (p % 2), column g + 8 (p // 2)), dequantized."""
    return deq_word_asm(4 + j, 8 + 2 * (j % 2), 9 + 2 * (j % 2), is_bf16)


@constexpr_function
def deq_word_asm(word: int, sz0: int, sz1: int, is_bf16: bool) -> str:
    """PTX dequantizing the packed word in register ``$word`` into $0..$3 (see ``_deq_asm``),
    with the scale/zero pairs of its columns g in ``$sz0`` and g + 8 in ``$sz1``."""
    magic = BF16_MAGIC if is_bf16 else FP16_MAGIC
    if is_bf16:  # bf16x2 sub/mul need sm_90; fma.rn.bf16x2 (sm_80) with z negated, -0.0 addend

        def sub(d, z):
            return f"fma.rn.bf16x2 {d}, {d}, one, {z};"

        def mul(d, s_):
            return f"fma.rn.bf16x2 {d}, {d}, {s_}, nzero;"

        negate = (
            ".reg .b32 one, nzero; mov.b32 one, 0x3f803f80; mov.b32 nzero, 0x80008000;\n"
            "xor.b32 z0, z0, nzero; xor.b32 z1, z1, nzero;\n"
        )
    else:

        def sub(d, z):
            return f"sub.f16x2 {d}, {d}, {z};"

        def mul(d, s_):
            return f"mul.f16x2 {d}, {d}, {s_};"

        negate = ""
    return (
        "{ .reg .b32 q, z0, s0, z1, s1;\n"
        f"mov.b32 q, ${word};\n"
        f"prmt.b32 s0, ${sz0}, 0, 0x1010; prmt.b32 z0, ${sz0}, 0, 0x3232;\n"
        f"prmt.b32 s1, ${sz1}, 0, 0x1010; prmt.b32 z1, ${sz1}, 0, 0x3232;\n"
        + negate
        + f"lop3.b32 $0, q, 0x000f000f, {magic:#x}, 0xea; shr.u32 q, q, 4;\n"
        f"lop3.b32 $1, q, 0x000f000f, {magic:#x}, 0xea; shr.u32 q, q, 4;\n"
        f"lop3.b32 $2, q, 0x000f000f, {magic:#x}, 0xea; shr.u32 q, q, 4;\n"
        f"lop3.b32 $3, q, 0x000f000f, {magic:#x}, 0xea;\n"
        f"{sub('$0', 'z0')} {mul('$0', 's0')}\n"
        f"{sub('$1', 'z0')} {mul('$1', 's0')}\n"
        f"{sub('$2', 'z1')} {mul('$2', 's1')}\n"
        f"{sub('$3', 'z1')} {mul('$3', 's1')} }}"
    )


@constexpr_function
def _deq_raw_asm(j: int, is_bf16: bool) -> str:
    """PTX for word ``j`` of the weight bundle ($4..$7): outputs $0..$3 = ``magic + q`` pairs
    (fp16 1024 + q / bf16 128 + q, exact); zero and scale are applied later per group."""
    magic = BF16_MAGIC if is_bf16 else FP16_MAGIC
    return (
        f"{{ .reg .b32 q; mov.b32 q, ${4 + j};\n"
        f"lop3.b32 $0, q, 0x000f000f, {magic:#x}, 0xea; shr.u32 q, q, 4;\n"
        f"lop3.b32 $1, q, 0x000f000f, {magic:#x}, 0xea; shr.u32 q, q, 4;\n"
        f"lop3.b32 $2, q, 0x000f000f, {magic:#x}, 0xea; shr.u32 q, q, 4;\n"
        f"lop3.b32 $3, q, 0x000f000f, {magic:#x}, 0xea; }}"
    )


@constexpr_function
def _xsum_asm(tm: int, step: int, is_bf16: bool) -> str:
    """Per-token sums of x over a k16 step, by an mma with an all-ones A: every output row holds
    the sum of token 2c (c0, c2) and 2c + 1 (c1, c3).  Operands as in ``_mma_asm`` with A = 1."""
    t = "bf16" if is_bf16 else "f16"
    one = 0x3F803F80 if is_bf16 else 0x3C003C00
    op = f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"
    head = f"{{ .reg .b32 one; mov.b32 one, {one:#x};\n"
    if tm == 8:
        b = 4 + 2 * step
        return (
            head
            + f"{op} {{$0, $1, $2, $3}}, {{one, one, one, one}}, {{${b}, ${b + 1}}}, {{$8, $9, $10, $11}}; }}"
        )
    return head + (
        f"{op} {{$0, $1, $2, $3}}, {{one, one, one, one}}, {{$8, $9}}, {{$12, $13, $14, $15}};\n"
        f"{op} {{$4, $5, $6, $7}}, {{one, one, one, one}}, {{$10, $11}}, {{$16, $17, $18, $19}}; }}"
    )


@constexpr_function
def _fold_asm(j: int, is_bf16: bool) -> str:
    """acc += s * (gacc - (magic + z) * xsum) for word ``j``'s columns g (c0, c1), g + 8 (c2, c3).

    $0..$3 out, $4..$7 acc, $8..$11 group partial sums of (magic + q) x, $12..$15 x sums,
    $16..$19 the scale/zero bundle (word 2 (j % 2) + t: scale low half, magic + z high half)."""
    sz0 = 16 + 2 * (j % 2)
    if is_bf16:  # bf16 -> fp32 is a 16-bit shift
        unpack = (
            f"shl.b32 s0, ${sz0}, 16; and.b32 z0, ${sz0}, 0xffff0000;\n"
            f"shl.b32 s1, ${sz0 + 1}, 16; and.b32 z1, ${sz0 + 1}, 0xffff0000;\n"
        )
    else:
        unpack = (
            f"mov.b32 {{lo, hi}}, ${sz0}; cvt.f32.f16 s0, lo; cvt.f32.f16 z0, hi;\n"
            f"mov.b32 {{lo, hi}}, ${sz0 + 1}; cvt.f32.f16 s1, lo; cvt.f32.f16 z1, hi;\n"
        )
    return (
        "{ .reg .b32 s0, z0, s1, z1, t; .reg .b16 lo, hi;\n"
        + unpack
        + "xor.b32 z0, z0, 0x80000000; xor.b32 z1, z1, 0x80000000;\n"
        "fma.rn.f32 t, z0, $12, $8; fma.rn.f32 $0, s0, t, $4;\n"
        "fma.rn.f32 t, z0, $13, $9; fma.rn.f32 $1, s0, t, $5;\n"
        "fma.rn.f32 t, z1, $14, $10; fma.rn.f32 $2, s1, t, $6;\n"
        "fma.rn.f32 t, z1, $15, $11; fma.rn.f32 $3, s1, t, $7; }"
    )


@constexpr_function
def _mma_asm(tm: int, step: int, is_bf16: bool) -> str:
    """mma.sync m16n8k16 with the dequantized weights as A (16 output columns x k16) and x as B.

    A = deq registers (p0, p2, p1, p3): register p holds (k 2c + 8 (p % 2), column g + 8 (p // 2)).
    TM = 8: out $0..$3, x bundle $4..$7 (k16 step ``step`` in $4+2step, $5+2step), A $8..$11,
    acc $12..$15.  TM = 16: out $0..$7, x $8..$11 (tokens 0-7 in $8,$9, 8-15 in $10,$11), A
    $12..$15, acc $16..$23."""
    t = "bf16" if is_bf16 else "f16"
    op = f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"
    if tm == 8:
        b = 4 + 2 * step
        return f"{op} {{$0, $1, $2, $3}}, {{$8, $10, $9, $11}}, {{${b}, ${b + 1}}}, {{$12, $13, $14, $15}};"
    return (
        f"{op} {{$0, $1, $2, $3}}, {{$12, $14, $13, $15}}, {{$8, $9}}, {{$16, $17, $18, $19}};\n"
        f"{op} {{$4, $5, $6, $7}}, {{$12, $14, $13, $15}}, {{$10, $11}}, {{$20, $21, $22, $23}};"
    )


@constexpr_function
def _mma_constraints(tm: int, ones: bool) -> str:
    n_out = tm // 2  # fp32 accumulator registers per lane and word
    return ",".join(["=f"] * n_out + ["r"] * (4 if ones else 8) + ["f"] * n_out)


_DEQ_CONSTRAINTS = "=r,=r,=r,=r," + ",".join(["r"] * 8)
DEQ_CONSTRAINTS = gl.constexpr(_DEQ_CONSTRAINTS)


_RAW_CONSTRAINTS = "=r,=r,=r,=r,r,r,r,r"
_FOLD_CONSTRAINTS = ",".join(["=f"] * 4 + ["f"] * 12 + ["r"] * 4)
RAW_CONSTRAINTS = gl.constexpr(_RAW_CONSTRAINTS)
FOLD_CONSTRAINTS = gl.constexpr(_FOLD_CONSTRAINTS)


@gluon.jit
def _word(
    wb, szb, xb, acc, J: gl.constexpr, STEP: gl.constexpr, TM: gl.constexpr,
    FOLD: gl.constexpr, IS_BF16: gl.constexpr,
):  # fmt: skip
    """Dequantize word J of the bundle and accumulate its 16 columns x TM tokens into ``acc``
    (a tuple of TM // 8 tensors).  FOLD: the A operand is ``magic + q`` (see ``_fold``)."""
    if FOLD:
        raw: gl.constexpr = _deq_raw_asm(J, IS_BF16)
        a = gl.inline_asm_elementwise(
            raw, RAW_CONSTRAINTS, [wb], dtype=gl.int32, is_pure=True, pack=4
        )
    else:
        deq: gl.constexpr = _deq_asm(J, IS_BF16)
        a = gl.inline_asm_elementwise(
            deq, DEQ_CONSTRAINTS, [wb, szb], dtype=gl.int32, is_pure=True, pack=4
        )
    return _mma(xb, a, acc, STEP, TM, False, IS_BF16)


@gluon.jit
def _mma(
    xb, a, acc, STEP: gl.constexpr, TM: gl.constexpr, ONES: gl.constexpr, IS_BF16: gl.constexpr
):
    """acc (tuple of TM // 8) += A x^T, A = ``a`` or (ONES, ``a`` None) all ones: per-token
    sums of x."""
    cons: gl.constexpr = _mma_constraints(TM, ONES)
    if ONES:
        asm: gl.constexpr = _xsum_asm(TM, STEP, IS_BF16)
        args = [xb]
    else:
        asm: gl.constexpr = _mma_asm(TM, STEP, IS_BF16)
        args = [xb, a]
    if TM == 8:
        res = (
            gl.inline_asm_elementwise(
                asm, cons, args + [acc[0]], dtype=gl.float32, is_pure=True, pack=4
            ),
        )
    else:
        res = gl.inline_asm_elementwise(
            asm, cons, args + [acc[0], acc[1]], dtype=(gl.float32, gl.float32), is_pure=True, pack=4
        )
    return res


@gluon.jit
def _fold(acc, gacc, xsum, szb, J: gl.constexpr, IS_BF16: gl.constexpr):
    """Close a (part of a) group for word J: acc += s * (gacc - (magic + z) * xsum)."""
    asm: gl.constexpr = _fold_asm(J, IS_BF16)
    return gl.inline_asm_elementwise(
        asm, FOLD_CONSTRAINTS, [acc, gacc, xsum, szb], dtype=gl.float32, is_pure=True, pack=4
    )


@gluon.jit
def _zeros(n: gl.constexpr, W: gl.constexpr, L3: gl.constexpr):
    res = ()
    for _ in gl.static_range(n):
        res = res + (gl.zeros([W, 32, 4], gl.float32, L3),)
    return res


@gluon.jit
def _step(
    wb, szl, szh, xb, accs, STEP: gl.constexpr, TM: gl.constexpr, FOLD: gl.constexpr,
    IS_BF16: gl.constexpr,
):  # fmt: skip
    """One k16 step of the 4 words of a bundle; accs[(TM // 8) j + h]: word j, tokens 8h.."""
    res = ()
    for j in gl.static_range(4):
        sz = szl if j < 2 else szh
        if TM == 8:
            res = res + _word(wb, sz, xb, (accs[j],), j, STEP, TM, FOLD, IS_BF16)
        else:
            res = res + _word(
                wb, sz, xb, (accs[2 * j], accs[2 * j + 1]), j, STEP, TM, FOLD, IS_BF16
            )
    return res


@gluon.jit
def _fold_all(accs, gaccs, xsums, szl, szh, TM: gl.constexpr, IS_BF16: gl.constexpr):
    res = ()
    for j in gl.static_range(4):
        sz = szl if j < 2 else szh
        for h in gl.static_range(TM // 8):
            res = res + (
                _fold(accs[(TM // 8) * j + h], gaccs[(TM // 8) * j + h], xsums[h], sz, j, IS_BF16),
            )
    return res


@gluon.jit
def _chunk(
    wbs, xs, szs, accs, gaccs, xsums, W: gl.constexpr, L3: gl.constexpr, CH: gl.constexpr,
    GKB: gl.constexpr, XS: gl.constexpr, TM: gl.constexpr, FOLD: gl.constexpr,
    IS_BF16: gl.constexpr,
):  # fmt: skip
    """The CH k16 steps of one chunk (FOLD: closing each group, or the chunk, on the way)."""
    FOLD_EVERY: gl.constexpr = GKB if GKB < CH else CH
    for u in gl.static_range(CH):
        wb = wbs[u]
        xb = xs[u // XS]
        szl = szs[2 * (u // GKB)]
        szh = szs[2 * (u // GKB) + 1]
        if FOLD:
            gaccs = _step(wb, szl, szh, xb, gaccs, u % XS, TM, True, IS_BF16)
            xsums = _mma(xb, None, xsums, u % XS, TM, True, IS_BF16)
            if u % FOLD_EVERY == FOLD_EVERY - 1:
                accs = _fold_all(accs, gaccs, xsums, szl, szh, TM, IS_BF16)
                gaccs = _zeros(4 * (TM // 8), W, L3)
                xsums = _zeros(TM // 8, W, L3)
        else:
            accs = _step(wb, szl, szh, xb, accs, u % XS, TM, False, IS_BF16)
    return accs, gaccs, xsums


@gluon.jit
def load_chunk(
    qf_ptr, x_ptr, sz_ptr, kb0, w_off, x_off, x_k, sz_off, nb_ok, KB, K2, NB,
    CH: gl.constexpr, GKB: gl.constexpr, XS: gl.constexpr, MASK_N: gl.constexpr,
    MASK_K: gl.constexpr, WORDS: gl.constexpr = True, X: gl.constexpr = True,
    SZ: gl.constexpr = True,
):  # fmt: skip
    """Issue every load of one chunk (CH k16 steps): weight (unless not WORDS; ``qf_ptr`` and
    ``w_off`` are then unused), x (unless not X) and scale/zero bundles (unless not SZ).
    Masked: x past K and groups past the last read zeros."""
    wbs = ()
    xs = ()
    szs = ()
    for u in gl.static_range(CH):
        kb = kb0 + u
        if MASK_N or MASK_K:
            ok = nb_ok & (kb < KB)
        if WORDS:
            if MASK_N or MASK_K:
                wbs = wbs + (gl.load(qf_ptr + w_off + kb * 128, mask=ok, other=0),)
            else:
                wbs = wbs + (gl.load(qf_ptr + w_off + kb * 128),)
        if X and u % XS == 0:
            if MASK_K:
                xk_ok = x_k + kb * 8 < K2
                xs = xs + (gl.load(x_ptr + x_off + kb * 8, mask=xk_ok, other=0),)
            else:
                xs = xs + (gl.load(x_ptr + x_off + kb * 8),)
        if SZ and u % GKB == 0:
            szp = sz_ptr + (kb // GKB) * (NB * 64) + sz_off
            if MASK_N or MASK_K:
                szs = szs + (gl.load(szp, mask=ok, other=0), gl.load(szp + 4, mask=ok, other=0))
            else:
                szs = szs + (gl.load(szp), gl.load(szp + 4))
    return wbs, xs, szs


@gluon.jit
def _finish_tile(
    acc, out_ptr, ws_ptr, bias_ptr, m, n, wsi, mask, N, stride_om,
    SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, LAST: gl.constexpr, MASK_N: gl.constexpr = True,
    SWAP: gl.constexpr = True,
):  # fmt: skip
    """Split-K: add into the workspace at ``wsi`` (LAST False), or, in the last CTA, take the
    sums and leave zeros (LAST True); then store (+ bias) in the output dtype.  MASK_N False:
    every ``n`` is a real column (lets the stores vectorize).  SWAP False: the last CTA reads
    the sums and writes the zeros with plain (vector) accesses instead of an atomic exchange
    per element; it runs after the acquiring ticket, so every add has landed in L2."""
    if MASK_N:
        mask = mask & (n < N)
    if SPLIT > 1 and not LAST:
        gl.atomic_add(ws_ptr + wsi, acc, mask=mask, sem="relaxed")
    else:
        if SPLIT == 1:
            v = acc
        elif SWAP:
            v = gl.atomic_xchg(ws_ptr + wsi, gl.zeros_like(acc), mask=mask, sem="relaxed")
        else:
            v = gl.load(ws_ptr + wsi, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(ws_ptr + wsi, gl.zeros_like(acc), mask=mask)
        if HAS_BIAS:
            v += gl.load(bias_ptr + n, mask=mask, other=0.0).to(gl.float32)
        gl.store(out_ptr + m * stride_om + n, v.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _finish(
    accs, out_ptr, ws_ptr, bias_ptr, w0, o0, rows, tok, n, N, NP, stride_om,
    TM: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, LAST: gl.constexpr,
    PER_ACC: gl.constexpr,
):  # fmt: skip
    # PER_ACC: accs[(TM // 8) j + h] holds columns n + 16 j, tokens tok + 8 h; otherwise
    # accs is one tensor whose n and tok already include j and h.  Token t of the tile is
    # output row o0 + t (t < rows) and workspace row w0 + t.
    # Workspace of a token tile: [NP columns, its tokens], so a warp's adds cover whole sectors
    # (M = 1: consecutive columns; M >= 8: the 8 tokens of a column).
    pitch = gl.minimum(rows, TM)
    NJ: gl.constexpr = 4 if PER_ACC else 1
    NH: gl.constexpr = TM // 8 if PER_ACC else 1
    for j in gl.static_range(NJ):
        for h in gl.static_range(NH):
            th = tok + 8 * h
            nj = n + 16 * j
            _finish_tile(
                accs[NH * j + h], out_ptr, ws_ptr, bias_ptr, o0 + th, nj,
                w0 * NP + nj * pitch + th, th < rows, N, stride_om, SPLIT, HAS_BIAS, LAST,
            )  # fmt: skip


@gluon.jit
def _tile_coords(W: gl.constexpr, WB: gl.constexpr, L3: gl.constexpr):
    """Per element (warp, lane l = 4g + c, register) of a ``[W, 32, 4]`` tensor in layout
    ``L3``, in a CTA of the grid ``(column tiles of WB blocks, token tiles, split)``: its
    block ``nb`` (warp w takes block w % WB), ``l3``, ``r3``, ``g``, ``c`` and the warp index."""
    warp = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    reg = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    w3 = gl.expand_dims(gl.expand_dims(warp, 1), 2)
    nb = gl.program_id(0) * WB + w3 % WB
    l3 = gl.expand_dims(gl.expand_dims(lane, 0), 2)
    r3 = gl.expand_dims(gl.expand_dims(reg, 0), 1)
    return nb, l3, r3, l3 // 4, l3 % 4, w3


@gluon.jit
def lane_coords(
    M, stride_xm, W: gl.constexpr, WB: gl.constexpr, TM: gl.constexpr, XS: gl.constexpr,
    L3: gl.constexpr,
):  # fmt: skip
    """``_tile_coords`` of the ``[W, 32, 4]`` tensors of a CTA whose warps cover WB column
    blocks, plus the offsets of each element's x pair (int32 units, ``x_k`` the pair index
    within a k16 step) and of its scale/zero word in a group."""
    mt = gl.program_id(1)
    nb, l3, r3, g, c, w3 = _tile_coords(W, WB, L3)

    # B fragment (x^T: k pairs x tokens): b0 (pair c, token g), b1 (pair c + 4, token g).
    # TM = 16: registers 2, 3 are tokens g + 8; TM = 8: they are the next k16 step (XS = 2).
    # Tokens past M read row M - 1 (finite data; those output columns are never stored).
    if TM == 16:
        xm = mt * 16 + g + 8 * (r3 // 2)
        x_k = c + 4 * (r3 % 2)
    else:
        xm = mt * 8 + g + 0 * r3
        x_k = c + 4 * (r3 % 2) + 8 * (XS - 1) * (r3 // 2)
    x_off = gl.minimum(xm, M - 1) * stride_xm + x_k
    sz_off = nb * 64 + g * 8 + r3
    return nb, l3, r3, g, c, x_off, x_k, sz_off, w3


@gluon.jit
def _sum_k_slices(accs, W: gl.constexpr, WK: gl.constexpr, TM: gl.constexpr, LR: gl.constexpr):
    """Warps w, w + WB, w + 2 WB, ... (WB = W / WK) summed the same outputs over different k
    ranges: their sums, ``[NACC, WB, 128]`` (accumulator (TM // 8) j + h, block, 4 lane +
    register) in ``SliceLayout(1, LR)``.  Each warp writes its accumulators to shared memory
    (512 contiguous bytes each), then every thread adds the WK partials of its own outputs."""
    NACC: gl.constexpr = 4 * (TM // 8)
    buf = gl.allocate_shared_memory(
        gl.float32, [NACC * W, 32, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    )
    for a in gl.static_range(NACC):
        buf.slice(a * W, W).store(accs[a])
    gl.thread_barrier()
    # warp w = k-slice (w // WB) x WB + block (w % WB): the same bytes as [acc, slice, block, 128]
    parts = buf._reinterpret(
        gl.float32, [NACC, WK, W // WK, 128], gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
    ).load(LR)
    return gl.sum(parts, axis=1)


@gluon.jit
def _reduced_tok_n(
    WB: gl.constexpr, TM: gl.constexpr, LS: gl.constexpr, NJ: gl.constexpr = 4
):  # fmt: skip
    """``tok`` and ``n`` (j and h included) of every element of ``_sum_k_slices``'s result
    (``NJ`` < 4: of its accumulators j < NJ only)."""
    NACC: gl.constexpr = NJ * (TM // 8)
    a = gl.arange(0, NACC, layout=gl.SliceLayout(1, gl.SliceLayout(2, LS)))
    b = gl.arange(0, WB, layout=gl.SliceLayout(0, gl.SliceLayout(2, LS)))
    e = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, LS)))
    a3 = gl.expand_dims(gl.expand_dims(a, 1), 2)
    nb = gl.program_id(0) * WB + gl.expand_dims(gl.expand_dims(b, 0), 2)
    e3 = gl.expand_dims(gl.expand_dims(e, 0), 1)
    tok, n = fragment_tok_n(e3 // 4 % 4, e3 // 16, e3 % 4, nb)
    return tok + 8 * (a3 % (TM // 8)), n + 16 * (a3 // (TM // 8))


@gluon.jit
def w4a16_mma_kernel(
    x_ptr,  # int32 view of x [M, K/2] (pairs of activations)
    qf_ptr,  # int32 [N/64, K/16, 32, 4]
    sz_ptr,  # int32 [n_groups, N/64, 8, 8]
    bias_ptr,
    out_ptr,  # [M, N], x's dtype
    ws_ptr,  # fp32 [>= M*N] zeros (split-K only)
    cnt_ptr,  # int32 [>= grid(0) * grid(1)] zeros (split-K only)
    M,
    N,  # true output features (stores are masked to them)
    K2,  # true input features / 2 (x pairs)
    NB,  # padded N / 64
    KB,  # padded K / 16
    n_iter,  # chunks per warp
    stride_xm,  # in int32 units
    stride_om,
    W: gl.constexpr,  # warps per CTA
    WK: gl.constexpr,  # warps per column block (each a different k range; W / WK blocks)
    CH: gl.constexpr,  # k16 steps per chunk
    GKB: gl.constexpr,  # k16 steps per quantization group
    TM: gl.constexpr,  # tokens per CTA tile: 8 (one mma per word) or 16 (two)
    SPLIT: gl.constexpr,  # CTAs per output tile along K
    PIPE: gl.constexpr,  # prefetch the next chunk while computing this one (registers)
    FOLD: gl.constexpr,  # zero and scale applied per group on the fp32 sums (see _fold)
    MASK_N: gl.constexpr,  # NB is not a multiple of W / WK
    MASK_K: gl.constexpr,  # the chunks overrun KB, or K is not a multiple of 16
    HAS_BIAS: gl.constexpr,
    IS_BF16: gl.constexpr,
    PDL: gl.constexpr = False,  # programmatic dependent launch (`common.pdl`)
):
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    XS: gl.constexpr = 2 if TM == 8 and CH % 2 == 0 else 1  # k16 steps per x bundle
    WB: gl.constexpr = W // WK
    mt = gl.program_id(1)
    sp = gl.program_id(2)
    pdl.release(PDL)

    nb, l3, r3, g, c, x_off, x_k, sz_off, w3 = lane_coords(M, stride_xm, W, WB, TM, XS, L3)
    nb_ok = nb < NB
    w_off = nb * (KB * 128) + l3 * 4 + r3
    # chunk (i SPLIT + sp) WK + w // WB of the K range is the i-th of warp w in CTA sp
    if WK > 1:
        kw = (w3 // WB) * CH
    else:
        kw = 0

    accs = _zeros(4 * (TM // 8), W, L3)
    # FOLD: per-group partial sums of (magic + q) x and per-token sums of x
    gaccs = _zeros(4 * (TM // 8) if FOLD else 0, W, L3)
    xsums = _zeros(TM // 8 if FOLD else 0, W, L3)
    # PDL: the first chunk's weights and scales are loaded before the wait for the previous
    # kernel, its x after (PIPE only: without it the loop loads every chunk again, so those
    # loads are dropped and all of them follow the wait); PIPE: the next chunk's loads are in
    # flight while this one is computed
    kb0 = sp * WK * CH + kw
    wbs, xs, szs = load_chunk(
        qf_ptr, x_ptr, sz_ptr, kb0, w_off, x_off, x_k, sz_off, nb_ok, KB, K2, NB,
        CH, GKB, XS, MASK_N, MASK_K, X=not PDL,
    )  # fmt: skip
    if PDL:
        x_off += pdl.wait(PDL)
        _, xs, _ = load_chunk(
            qf_ptr, x_ptr, sz_ptr, kb0, w_off, x_off, x_k, sz_off, nb_ok, KB, K2, NB,
            CH, GKB, XS, MASK_N, MASK_K, WORDS=False, SZ=False,
        )  # fmt: skip
    for i in range(n_iter):
        if PIPE:
            kb_next = ((i + 1) * SPLIT + sp) * WK * CH + kw
        else:
            kb_next = (i * SPLIT + sp) * WK * CH + kw
        nwbs, nxs, nszs = load_chunk(
            qf_ptr, x_ptr, sz_ptr, kb_next, w_off, x_off, x_k, sz_off, nb_ok, KB, K2, NB,
            CH, GKB, XS, MASK_N or PIPE, MASK_K or PIPE,
        )  # fmt: skip
        if not PIPE:
            wbs = nwbs
            xs = nxs
            szs = nszs
        accs, gaccs, xsums = _chunk(
            wbs, xs, szs, accs, gaccs, xsums, W, L3, CH, GKB, XS, TM, FOLD, IS_BF16
        )
        wbs = nwbs
        xs = nxs
        szs = nszs

    tok, n = fragment_tok_n(c, g, r3, nb)
    if WK > 1:
        # one thread per output (and WK partials in its registers): lanes along the 128
        # outputs of an accumulator, warps along accumulators and 32-output quarters
        WE: gl.constexpr = 4 if W >= 4 else W
        LR: gl.constexpr = gl.BlockedLayout(
            [1, WK, 1, 1], [1, 1, 1, 32], [W // WE, 1, 1, WE], [3, 2, 1, 0]
        )
        accs = (_sum_k_slices(accs, W, WK, TM, LR),)
        tok, n = _reduced_tok_n(WB, TM, gl.SliceLayout(1, LR))
    epilogue(
        accs, out_ptr, ws_ptr, cnt_ptr, bias_ptr, mt, tok, n, M, N, NB, stride_om,
        TM, SPLIT, HAS_BIAS, WK == 1,
    )  # fmt: skip


@gluon.jit
def fragment_tok_n(c, g, r3, nb):
    """Token (within the tile) and column of accumulator register r3 of lane 4g + c in the
    warp of block nb (j = h = 0; see ``_finish``)."""
    return 2 * c + r3 % 2, nb * 64 + g + 8 * (r3 // 2)


@gluon.jit
def epilogue(
    accs, out_ptr, ws_ptr, cnt_ptr, bias_ptr, mt, tok, n, M, N, NB, stride_om,
    TM: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, PER_ACC: gl.constexpr = True,
):  # fmt: skip
    """Store the tile of a CTA (grid ``(column tiles, token tiles, SPLIT)``): tokens
    ``mt * TM ..`` of M, see `epilogue_rows`."""
    epilogue_rows(
        accs, out_ptr, ws_ptr, cnt_ptr, bias_ptr, mt, mt * TM, M - mt * TM, tok, n, N, NB,
        stride_om, TM, SPLIT, HAS_BIAS, PER_ACC,
    )  # fmt: skip


@gluon.jit
def epilogue_rows(
    accs, out_ptr, ws_ptr, cnt_ptr, bias_ptr, mt, o0, rows, tok, n, N, NB, stride_om,
    TM: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, PER_ACC: gl.constexpr = True,
):  # fmt: skip
    """Store the tile of token tile ``mt`` (grid ``(column tiles, token tiles, SPLIT)``) as
    output rows ``o0 .. o0 + min(rows, TM)``; split-K: add into the workspace, and the last CTA
    of the tile to arrive stores the sums and leaves zeros. ``tok``/``n``: see ``_finish``."""
    w0 = mt * TM
    NP = NB * 64
    if SPLIT > 1:
        _finish(
            accs, out_ptr, ws_ptr, bias_ptr, w0, o0, rows, tok, n, N, NP, stride_om,
            TM, SPLIT, HAS_BIAS, False, PER_ACC,
        )  # fmt: skip
        gl.thread_barrier()
        cnt = cnt_ptr + gl.program_id(0) * gl.num_programs(1) + mt
        ticket = gl.atomic_add(cnt, 1, sem="acq_rel")
        if ticket == SPLIT - 1:
            gl.atomic_xchg(cnt, 0, sem="relaxed")
            _finish(
                accs, out_ptr, ws_ptr, bias_ptr, w0, o0, rows, tok, n, N, NP, stride_om,
                TM, SPLIT, HAS_BIAS, True, PER_ACC,
            )  # fmt: skip
    else:
        _finish(
            accs, out_ptr, ws_ptr, bias_ptr, w0, o0, rows, tok, n, N, NP, stride_om,
            TM, SPLIT, HAS_BIAS, True, PER_ACC,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# host side

_num_sms = splitk.num_sms
_workspace = splitk.workspace
_WORKSPACE = splitk.WORKSPACE
split_plan = splitk.split_plan


def plan(
    M: int,
    N: int,
    K: int,
    device,
    warps: int = 4,
    chunk: int = 8,
    ctas_per_sm: int = 4,
    tm: int = 16,
    wk: int = 1,
):
    """(split, n_iter): CTAs per output tile along K, and chunks (of ``chunk`` k16 steps) per warp.

    The fewest chunks per warp that keeps the grid within ``ctas_per_sm`` CTAs per SM; a CTA's
    ``wk`` warps per block take ``wk`` chunks side by side."""
    return _plan(M, N, K, _num_sms(device), warps, chunk, ctas_per_sm, tm, wk)


@functools.lru_cache(maxsize=4096)
def _plan(
    M: int, N: int, K: int, sms: int, warps: int, chunk: int, ctas_per_sm: int, tm: int, wk: int
):
    chunks = triton.cdiv(triton.cdiv(K // 16, chunk), wk)  # chunks of wk side by side
    tiles = triton.cdiv(N // 64, warps // wk) * triton.cdiv(M, tm)
    target = ctas_per_sm * sms
    n_iter = 1
    while n_iter < chunks and tiles * triton.cdiv(chunks, n_iter) > target:
        n_iter *= 2
    split = triton.cdiv(chunks, n_iter)
    n_iter = triton.cdiv(chunks, split)
    return split, n_iter


def as_int32_pairs(x2: torch.Tensor) -> torch.Tensor:
    """x2 with unit column stride, an even row stride and a 4-byte aligned start, so that the
    kernels can read it as int32 pairs of activations."""
    if x2.stride(1) != 1 or x2.stride(0) % 2:
        x2 = x2.contiguous()
    if x2.data_ptr() % 4:
        x2 = x2.clone()
    return x2


def group_steps(group_size: int, K: int, KB: int, steps: int, kernel: str) -> tuple[int, int]:
    """(k16 steps per quantization group, k16 steps per chunk or stage) for a kernel that
    handles ``steps`` k16 steps at a time: the chunk shrinks to gcd(group, chunk) unless one
    divides the other, so a group never starts inside a chunk; per-channel (``group_size >=
    K``) is one group covering every chunk."""
    if group_size >= K:
        return triton.cdiv(KB, steps) * steps, steps
    if group_size % 16:
        raise ValueError(f"w4a16 {kernel} kernel: group size {group_size} is not a multiple of 16")
    gkb = group_size // 16
    return gkb, steps if gkb % steps == 0 or steps % gkb == 0 else math.gcd(gkb, steps)


def w4a16_mma_matmul(
    x2: torch.Tensor,
    qf: torch.Tensor,
    sz: torch.Tensor,
    N: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    warps: int = 4,
    chunk: int = 8,
    ctas_per_sm: int = 4,
    pipe: bool = False,
    fold: bool = False,
    wk: int = 1,
) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W (+ bias); x2 fp16/bf16 on CUDA, K even.

    ``qf``/``sz``: pack_mma / pack_mma_scales tensors (padded to 16 x 64), ``sz`` in x's dtype.
    ``warps`` per CTA, ``wk`` of them per 64-column block (each a k range; their sums meet in
    shared memory), so a CTA covers ``warps / wk`` blocks."""
    M, K = x2.shape
    NB, KB = qf.shape[:2]
    x2 = as_int32_pairs(x2)
    gkb, chunk = group_steps(group_size, K, KB, chunk, "mma")
    tm = 8 if M <= 8 else 16
    if wk < 1 or warps % wk:
        raise ValueError(
            f"w4a16 mma kernel: wk = {wk} warps per column block does not divide warps = {warps}"
        )
    wb = warps // wk
    split, n_iter = plan(M, NB * 64, KB * 16, x2.device, warps, chunk, ctas_per_sm, tm, wk)
    mt = triton.cdiv(M, tm)
    out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    grid = (triton.cdiv(NB, wb), mt, split)
    ws, cnt = _workspace(x2.device, mt * tm * NB * 64 if split > 1 else 1, grid[0] * mt)
    has_bias = bias is not None
    w4a16_mma_kernel[grid](
        x2.view(torch.int32), qf, sz, bias if has_bias else out, out, ws, cnt,
        M, N, K // 2, NB, KB, n_iter, x2.stride(0) // 2, out.stride(0),
        W=warps, WK=wk, CH=chunk, GKB=gkb, TM=tm, SPLIT=split, PIPE=pipe, FOLD=fold,
        MASK_N=NB % wb != 0, MASK_K=split * wk * n_iter * chunk != KB or K != KB * 16,
        HAS_BIAS=has_bias, IS_BF16=x2.dtype == torch.bfloat16, num_warps=warps,
        **pdl.launch_options(pdl.enabled(x2.device)),
    )  # fmt: skip
    return out
