"""Gluon kernel for kbit (K = 2, 4) at small M: codebook lookups from a shared-memory table
straight into ``mma.sync`` fragments, the E4M4 block scale applied once per block.

It reads the field-packed layout of ``kbit/layout.py`` as it is (no second copy of a weight):
``qweight int32 [N_pad, KB_pad * bits]`` (column n, block b: ``bits`` words; K = 4: word ``w``
holds elements ``8w .. 8w + 7`` as nibbles; K = 2: word ``w`` holds elements ``16w .. 16w + 15``
as 2-bit fields; quad-interleaved, so word w of 4 consecutive blocks is one 16-byte load) and
``scales uint8 [N_pad, KB_pad]`` read as int32 (4 blocks per word).

The mma runs transposed as the W4A16 kernel's (``w4a16/triton/mma.py``): 16 output columns x
k16 of weights as A, x as B (k16 x 8 tokens).  A k16 step is *virtual*: lane ``l = 4g + c``
supplies the elements ``8c + 4v .. 8c + 4v + 3`` of a block as the step ``v`` (0, 1) of that
block, and x is read with the same permutation, so each lane reads one word (K = 4) or half a
word (K = 2) per column and block and every byte it reads is used:

* K = 4: byte ``2v`` of word c (elements ``8c + 4v``, ``+1``) is A register (k 2c), byte
  ``2v + 1`` register (k 2c + 8).
* K = 2: byte ``2 (c % 2) + v`` of word ``c // 2`` holds the 4 elements: both registers.

A byte is decoded by one load from a table in shared memory (``lut``: per byte value, the 2
(K = 4) or 4 (K = 2) levels it encodes, times 16, in x's dtype, packed as the registers want
them), kept in ``R`` copies (copy ``lane % R``) against bank conflicts.  The table lives at the
start of the CTA's shared memory (``global_smem``), the kernel's only allocation; the inline PTX
addresses it directly.

Each block's two mma steps go into a fresh fp32 sum that is folded into the accumulator with
the block's scale: E4M4 ``e m`` shifted left by 6 is the fp16 ``absmax / 16`` exactly
(subnormals included), hence the table's factor 16.  Split-K partials meet in the W4A16
kernel's self-cleaning workspace.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

from quantfw.kernels.common import splitk
from quantfw.kernels.kbit.configs import MMA_BITS
from quantfw.kernels.kbit.layout import _as_int32
from quantfw.kernels.w4a16.triton.mma import (
    _mma,
    _tile_coords,
    _workspace,
    _zeros,
    as_int32_pairs,
    epilogue,
    fragment_tok_n,
)

#: elements per chunk of the K loop are CH blocks of 32; scales come as 4 blocks per word
SCALE_BLOCKS = gl.constexpr(4)


@constexpr_function
def _lookup_asm(bits: int, r: int, v: int, copies: int) -> str:
    """PTX: A registers $0..$3 of block ``r`` (of the bundles) and step ``v`` for the columns
    g (weight bundle $4..$7) and g + 8 ($8..$11); $12: the lane's table base address, $16,
    $17 (K = 2): its byte selectors of steps 0 and 1."""
    stride = 4 * copies * (1 if bits == 4 else 2)  # bytes per table entry, all copies
    if bits == 4:  # register p: byte 2v + p % 2 of the word of column g + 8 (p // 2)
        srcs = [4 + r, 4 + r, 8 + r, 8 + r]
        out = [
            f"prmt.b32 t, ${srcs[p]}, 0, {0x4440 + 2 * v + p % 2:#x}; mad.lo.u32 t, t, {stride},"
            f" $12; ld.shared.b32 ${p}, [t];"
            for p in range(4)
        ]
    else:  # registers 0, 1 (column g) and 2, 3 (g + 8): one 8-byte entry each
        out = [
            f"prmt.b32 t, ${4 * (h + 1) + r}, 0, ${16 + v}; mad.lo.u32 t, t, {stride}, $12;"
            f" ld.shared.v2.b32 {{${2 * h}, ${2 * h + 1}}}, [t];"
            for h in range(2)
        ]
    return "{ .reg .b32 t;\n" + "\n".join(out) + " }"


@constexpr_function
def _scale_fold_asm(j: int, r: int) -> str:
    """PTX: $0..$3 = acc ($4..$7) + s * partial ($8..$11), s the scale of columns g ($0, $1)
    and g + 8 ($2, $3) of word j: byte ``r`` of scale-bundle registers 2 (j % 2) and
    2 (j % 2) + 1 ($12..$15)."""
    a, b = 12 + 2 * (j % 2), 13 + 2 * (j % 2)
    return (
        "{ .reg .b32 s; .reg .b16 lo, hi; .reg .f32 s0, s1;\n"
        f"prmt.b32 s, ${a}, ${b}, {r + ((4 + r) << 8):#x};\n"
        "and.b32 s, s, 0x00ff00ff; shl.b32 s, s, 6;\n"
        "mov.b32 {lo, hi}, s; cvt.f32.f16 s0, lo; cvt.f32.f16 s1, hi;\n"
        "fma.rn.f32 $0, s0, $8, $4; fma.rn.f32 $1, s0, $9, $5;\n"
        "fma.rn.f32 $2, s1, $10, $6; fma.rn.f32 $3, s1, $11, $7; }"
    )


_LOOKUP_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 16))
_FOLD_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 4 + ["f"] * 8 + ["r"] * 4))
_BASE_ASM = gl.constexpr("{ .reg .b32 b; mov.u32 b, global_smem; add.u32 $0, $1, b; }")


@gluon.jit
def _lookup(
    w0, w1, lb, sel, R: gl.constexpr, V: gl.constexpr, BITS: gl.constexpr, COPIES: gl.constexpr
):
    asm: gl.constexpr = _lookup_asm(BITS, R, V, COPIES)
    return gl.inline_asm_elementwise(
        asm, _LOOKUP_CONSTRAINTS, [w0, w1, lb, sel], dtype=gl.int32, is_pure=True, pack=4
    )


@gluon.jit
def _scale_fold(acc, part, sb, J: gl.constexpr, R: gl.constexpr):
    asm: gl.constexpr = _scale_fold_asm(J, R)
    return gl.inline_asm_elementwise(
        asm, _FOLD_CONSTRAINTS, [acc, part, sb], dtype=gl.float32, is_pure=True, pack=4
    )


@gluon.jit
def _load_chunk(
    q_ptr, x_ptr, s_ptr, b0, q_off, x_off, x_pair, s_off, nb_ok, KBP, K2,
    CH: gl.constexpr, TM: gl.constexpr, BITS: gl.constexpr, MASK: gl.constexpr,
):  # fmt: skip
    """Every load of the chunk of CH blocks from block ``b0``: weight bundles (per 4 blocks and
    word j, t: ``ws[(4 (r // 4) + j) 2 + t]``, register = block), x bundles (TM = 8: one per
    block, registers = its 4 pairs; TM = 16: one per block and step), scale bundles (per 4
    blocks: j < 2, j >= 2; register 2 (j % 2) + t)."""
    ws = ()
    xs = ()
    ss = ()
    for q4 in gl.static_range(CH // SCALE_BLOCKS):
        bq = b0 + SCALE_BLOCKS * q4
        ok = nb_ok & (bq < KBP) if MASK else nb_ok
        for jt in gl.static_range(8):
            col = (16 * (jt // 2) + 8 * (jt % 2)) * (KBP * BITS)
            ws = ws + (gl.load(q_ptr + q_off + (col + bq * BITS), mask=ok, other=0),)
        for h in gl.static_range(2):
            col = 32 * h * (KBP // SCALE_BLOCKS)
            ss = ss + (gl.load(s_ptr + s_off + (col + bq // SCALE_BLOCKS), mask=ok, other=0),)
    for r in gl.static_range(CH):
        xp = (b0 + r) * 16
        if TM == 8:
            xs = xs + (gl.load(x_ptr + x_off + xp, mask=x_pair + xp < K2, other=0),)
        else:
            for v in gl.static_range(2):
                xk = x_pair + xp + 2 * v
                xs = xs + (gl.load(x_ptr + x_off + xp + 2 * v, mask=xk < K2, other=0),)
    return ws, xs, ss


@gluon.jit
def _chunk(
    ws, xs, ss, accs, lb, sel, W: gl.constexpr, L3: gl.constexpr, CH: gl.constexpr,
    TM: gl.constexpr, BITS: gl.constexpr, COPIES: gl.constexpr, IS_BF16: gl.constexpr,
):  # fmt: skip
    """The CH blocks of a chunk: per block and word j, two mma steps into a fresh partial sum,
    then acc += scale * partial."""
    NH: gl.constexpr = TM // 8
    for rr in gl.static_range(CH):
        res = ()
        for j in gl.static_range(4):
            part = _zeros(NH, W, L3)
            w0 = ws[8 * (rr // SCALE_BLOCKS) + 2 * j]
            w1 = ws[8 * (rr // SCALE_BLOCKS) + 2 * j + 1]
            for v in gl.static_range(2):
                a = _lookup(w0, w1, lb, sel, rr % SCALE_BLOCKS, v, BITS, COPIES)
                if TM == 8:
                    part = _mma(xs[rr], a, part, v, TM, False, IS_BF16)
                else:
                    part = _mma(xs[2 * rr + v], a, part, 0, TM, False, IS_BF16)
            sb = ss[2 * (rr // SCALE_BLOCKS) + j // 2]
            for h in gl.static_range(NH):
                res = res + (_scale_fold(accs[NH * j + h], part[h], sb, j, rr % SCALE_BLOCKS),)
        accs = res
    return accs


@gluon.jit
def kbit_mma_kernel(
    x_ptr,  # int32 view of x [M, K/2] (pairs of activations)
    q_ptr,  # int32 [N_pad, KB_pad * BITS] (field-packed)
    s_ptr,  # int32 view of the E4M4 scales [N_pad, KB_pad / 4]
    lut_ptr,  # int32 [256, EW]: per byte, the registers its levels make (times 16, x's dtype)
    bias_ptr,
    out_ptr,  # [M, N], x's dtype
    ws_ptr,  # fp32 [>= M*N] zeros (split-K only)
    cnt_ptr,  # int32 [>= grid(0) * grid(1)] zeros (split-K only)
    M,
    N,  # true output features (stores are masked to them)
    K2,  # true input features / 2 (x pairs)
    NB,  # N_pad / 64
    KBP,  # KB_pad: blocks of 32 per column
    n_iter,  # chunks per CTA
    stride_xm,  # in int32 units
    stride_om,
    W: gl.constexpr,  # warps per CTA, one 64-column block each
    CH: gl.constexpr,  # blocks per chunk (a multiple of 4)
    TM: gl.constexpr,  # tokens per CTA tile: 8 or 16
    SPLIT: gl.constexpr,  # CTAs per output tile along K
    COPIES: gl.constexpr,  # copies of the table in shared memory (lane % COPIES reads its own)
    BITS: gl.constexpr,  # 2 or 4
    PIPE: gl.constexpr,  # prefetch the next chunk while computing this one
    MASK_N: gl.constexpr,  # NB is not a multiple of W
    MASK_K: gl.constexpr,  # the chunks overrun KB_pad
    HAS_BIAS: gl.constexpr,
    IS_BF16: gl.constexpr,
):
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    EW: gl.constexpr = 1 if BITS == 4 else 2  # table words per entry
    mt = gl.program_id(1)
    sp = gl.program_id(2)

    nb, l3, r3, g, c, w3 = _tile_coords(W, W, L3)
    if MASK_N:
        nb_ok = nb < NB
    else:
        nb_ok = nb >= 0
    # the lane's table base (bytes, in the shared window) and K = 2 byte selectors per step
    lb0 = (l3 % COPIES) * (4 * EW) + 0 * r3
    lb = gl.inline_asm_elementwise(_BASE_ASM, "=r,r", [lb0], dtype=gl.int32, is_pure=True, pack=1)
    sel = 0x4440 + 2 * (c % 2) + r3 % 2
    if BITS == 4:
        word = c
    else:
        word = c // 2
    # weight bundle (j, t): column 64 nb + 16 j + 8 t + g, register r3 = block r3 of the 4
    # (its word `word`: quad-interleaved, the 4 are contiguous);
    # scale bundle h: column 64 nb + 32 h + 16 (r3 // 2) + 8 (r3 % 2) + g (j = 2h + r3 // 2)
    q_off = (nb * 64 + g) * (KBP * BITS) + 4 * word + r3
    s_off = (nb * 64 + 16 * (r3 // 2) + 8 * (r3 % 2) + g) * (KBP // SCALE_BLOCKS)
    # x: TM = 8: token g, pairs 4c + r3 of the block; TM = 16: token g + 8 (r3 // 2), pairs
    # 4c + 2v + r3 % 2.  Tokens past M read row M - 1 (never stored).
    if TM == 8:
        xm = mt * 8 + g + 0 * r3
        x_pair = 4 * c + r3
    else:
        xm = mt * 16 + g + 8 * (r3 // 2)
        x_pair = 4 * c + r3 % 2
    x_off = gl.minimum(xm, M - 1) * stride_xm + x_pair

    # the first chunk's loads go out before the table is built
    ws, xs, ss = _load_chunk(
        q_ptr, x_ptr, s_ptr, sp * CH, q_off, x_off, x_pair, s_off, nb_ok, KBP, K2,
        CH, TM, BITS, MASK_K,
    )  # fmt: skip
    # the table, COPIES times: word (e COPIES + copy) EW + i = lut[e, i]; consecutive lanes
    # store consecutive copies (no bank conflicts)
    LF: gl.constexpr = gl.BlockedLayout([1, 1, EW], [32 // COPIES, COPIES, 1], [W, 1, 1], [2, 1, 0])
    e = gl.arange(0, 256, layout=gl.SliceLayout(1, gl.SliceLayout(1, LF)))
    i = gl.arange(0, EW, layout=gl.SliceLayout(0, gl.SliceLayout(1, LF)))
    lut2 = gl.load(lut_ptr + gl.expand_dims(e, 1) * EW + gl.expand_dims(i, 0))
    lut3 = gl.expand_dims(lut2, 1) + gl.zeros([256, COPIES, EW], gl.int32, LF)
    table = gl.allocate_shared_memory(
        gl.int32, [256, COPIES, EW], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    )
    table.store(lut3)
    gl.thread_barrier()

    accs = _zeros(4 * (TM // 8), W, L3)
    for it in range(n_iter - 1):  # the last chunk after the loop: no loads past the plan
        b_next = ((it + 1) * SPLIT + sp) * CH
        if PIPE:  # the next chunk's loads before this chunk's math
            nws, nxs, nss = _load_chunk(
                q_ptr, x_ptr, s_ptr, b_next, q_off, x_off, x_pair, s_off, nb_ok, KBP, K2,
                CH, TM, BITS, MASK_K,
            )  # fmt: skip
            accs = _chunk(ws, xs, ss, accs, lb, sel, W, L3, CH, TM, BITS, COPIES, IS_BF16)
            ws = nws
            xs = nxs
            ss = nss
        else:
            accs = _chunk(ws, xs, ss, accs, lb, sel, W, L3, CH, TM, BITS, COPIES, IS_BF16)
            ws, xs, ss = _load_chunk(
                q_ptr, x_ptr, s_ptr, b_next, q_off, x_off, x_pair, s_off, nb_ok, KBP, K2,
                CH, TM, BITS, MASK_K,
            )  # fmt: skip
    accs = _chunk(ws, xs, ss, accs, lb, sel, W, L3, CH, TM, BITS, COPIES, IS_BF16)

    tok, n = fragment_tok_n(c, g, r3, nb)
    epilogue(
        accs, out_ptr, ws_ptr, cnt_ptr, bias_ptr, mt, tok, n, M, N, NB, stride_om,
        TM, SPLIT, HAS_BIAS,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# host side


def lookup_table(codebook: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """int32 ``[256, 1]`` (K = 4) or ``[256, 2]`` (K = 2): for each byte value, the mma
    registers its 2 or 4 fields make, as ``16 * codebook[field]`` in `dtype` (low half = the
    lower field)."""
    if bits not in MMA_BITS:
        raise ValueError(f"kbit mma kernel: bits must be one of {MMA_BITS}, got {bits}")
    byte = torch.arange(256, device=codebook.device)
    f = 8 // bits  # fields per byte, lowest bits first
    fields = (byte[:, None] >> (bits * torch.arange(f, device=byte.device))) & ((1 << bits) - 1)
    half = (16 * codebook.to(torch.float32)[fields]).to(dtype).view(torch.int16)
    half = half.to(torch.int64) & 0xFFFF
    return _as_int32(half[:, 0::2] | (half[:, 1::2] << 16)).contiguous()


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
) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W.T (+ bias) for a field-packed weight (``qweight``, ``scales``
    of `layout.KbitWeight`) and its `lookup_table` ``lut`` in x's dtype; x2 fp16/bf16 on CUDA.

    ``chunk`` blocks of 32 per K step (a multiple of 4), ``copies`` of the table in shared
    memory (1..32, a power of two), ``warps`` 64-column blocks per CTA, ``maxnreg`` a cap on
    registers per thread (None: the compiler's choice)."""
    if bits not in MMA_BITS:
        raise ValueError(f"kbit mma kernel: bits must be one of {MMA_BITS}, got {bits}")
    if chunk % SCALE_BLOCKS.value or chunk <= 0:
        raise ValueError(f"kbit mma kernel: chunk={chunk} blocks must be a multiple of 4")
    if copies not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"kbit mma kernel: copies={copies} must be a power of two <= 32")
    M, K = x2.shape
    n_pad, kbp = scales.shape
    NB = n_pad // 64
    x2 = as_int32_pairs(x2)
    tm = 8 if M <= 8 else 16
    mt = triton.cdiv(M, tm)
    tiles = triton.cdiv(NB, warps) * mt
    split, n_iter = splitk.split_plan(
        triton.cdiv(kbp, chunk), tiles, splitk.num_sms(x2.device), ctas_per_sm
    )
    out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    grid = (triton.cdiv(NB, warps), mt, split)
    ws, cnt = _workspace(x2.device, mt * tm * n_pad if split > 1 else 1, grid[0] * mt)
    has_bias = bias is not None
    kbit_mma_kernel[grid](
        x2.view(torch.int32), qweight, scales.view(torch.int32), lut,
        bias if has_bias else out, out, ws, cnt,
        M, N, K // 2, NB, kbp, n_iter, x2.stride(0) // 2, out.stride(0),
        W=warps, CH=chunk, TM=tm, SPLIT=split, COPIES=copies, BITS=bits, PIPE=pipe,
        MASK_N=NB % warps != 0, MASK_K=split * n_iter * chunk != kbp,
        HAS_BIAS=has_bias, IS_BF16=x2.dtype == torch.bfloat16, num_warps=warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )  # fmt: skip
    return out
