"""kbit weights through the Hopper wgmma kernel of `mxfp4.triton.wgmma` (batches of 17 or more
tokens on sm_90; by default in calls made for CUDA graphs, `triton.dispatch`): the field-packed
K = 4 layout is MXFP4's runtime layout byte for byte, K = 2's has the same quads with 2 words a
block, and K = 3 and 5 add a 1-bit word a block to K = 2's and K = 4's (`kbit.layout`), which
the kernel copies into a shared-memory slot of its own. So only the decode of the 8 fields a
lane takes differs, given here as inline PTX.

The levels, as ``16 * level`` in the activation dtype, are split into their low and high bytes
(entries ``4 i .. 4 i + 3`` in register i: ``2**K / 4`` registers each), which become
immediates of the PTX, so the kernel is compiled once per codebook and dtype. ``prmt`` picks
bytes among 8 by 3-bit selectors, four at a time; the selectors of the lane's 8 indices are
the nibbles of a word:

* K = 4, 5 (a word of 8 nibbles, element ``8 c + t`` at bits ``4 t``; the low, then the high
  16 bits): one ``prmt`` per register pair looks up bits 0..2 of each index among 8 entries,
  a ``prmt`` in sign-replicate mode turns each index's bit 3 into a byte mask, and ``lop3``
  picks between two lookups; at K = 5 the lane's 1-bit fields (byte c of the 1-bit word)
  become bit 4's byte mask the same way, and a third ``lop3`` picks between two such pairs;
* K = 2, 3 (the lane's 16 bits of 2-bit fields: the kernel shifts word ``c // 2`` by ``16 (c
  % 2)``): three shift-or-mask steps spread the fields to nibbles, at K = 3 the 1-bit fields
  are spread to bit 2 of the same nibbles, and one ``prmt`` per byte register pair looks them
  up.

Two ``prmt`` then pair low and high bytes into values, and each pair is multiplied by the E4M4
scale: its byte shifted left by 6 is the fp16 of ``absmax / 16`` (exact, subnormals included;
for bf16 converted through float32, exact), so a value is ``16 * level`` (rounded to the dtype)
times ``absmax / 16``, rounded once. The tests run this PTX on the CPU
(``tests/support/ptx_exec.py``).
"""

from __future__ import annotations

import torch

from quantfw.kernels.kbit.layout import KbitWeight

#: prmt selectors of the sign-replicate mode: bit 7 of bytes 0, 0, 1, 1 (values 0..3) or 2,
#: 2, 3, 3 (values 4..7) of a and b alternately, over the four output bytes. With a = w << 4,
#: b = w they replicate bit 3 of each nibble of w; with a = v << 7, b = v << 3, bit 0 of each
_MASK_SELECTORS = (0xD9C8, 0xFBEA)
#: 16 bits of 2-bit fields spread to 8 nibbles, (shift, mask) per step
_SPREAD = ((8, 0x00FF00FF), (4, 0x0F0F0F0F), (2, 0x33333333))
#: 8 bits of 1-bit fields spread to bit 0 of 8 nibbles
_SPREAD_BITS = ((12, 0x000F000F), (6, 0x03030303), (3, 0x11111111))
#: prmt selectors pairing low (a) and high (b) bytes into values (0, 1) and (2, 3)
_PAIR_SELECTORS = (0x5140, 0x7362)
#: table registers (low and high bytes together) -> K
_TABLE_BITS = {2: 2, 4: 3, 8: 4, 16: 5}
#: the DECODE operands: with pack = 8, the word is $4; at K = 3, 5 the 1-bit word is $12 and
#: the scale $20, else the scale is $12 (`mxfp4.triton.wgmma`'s two operand lists)
WORD, ONES, SCALE, SCALE_WITH_ONES = 4, 12, 12, 20


def table_words(codebook: torch.Tensor, dtype: torch.dtype) -> tuple[int, ...]:
    """The registers of the lookup: low bytes of ``16 * codebook`` in `dtype`, entries ``4 i
    .. 4 i + 3`` in register i, then their high bytes (``2**K / 2`` registers in all)."""
    n = codebook.numel()
    if n not in (4, 8, 16, 32):
        raise ValueError(f"kbit wgmma: a codebook of 4, 8, 16 or 32 levels (K = 2..5), got {n}")
    half = (16 * codebook.detach().cpu().to(torch.float32)).to(dtype).view(torch.int16)
    half = [int(v) & 0xFFFF for v in half.tolist()]
    words = []
    for shift in (0, 8):
        for i in range(n // 4):
            words.append(sum(((half[4 * i + b] >> shift) & 0xFF) << (8 * b) for b in range(4)))
    return tuple(words)


def _lookup_asm(dst: str, regs: tuple[int, ...]) -> str:
    """PTX: `dst` = the bytes of `regs` (4 entries each) chosen by index bits 0..2 in the
    nibbles of ``s``, bit 3 by byte mask ``m`` and bit 4 by ``m4`` (uses t0..t3)."""
    if len(regs) == 1:
        return f"prmt.b32 {dst}, {regs[0]:#x}, 0, s;\n"
    pairs = zip(regs[0::2], regs[1::2], strict=True)
    groups = [f"prmt.b32 t{g}, {a:#x}, {b:#x}, s;" for g, (a, b) in enumerate(pairs)]
    if len(groups) == 1:
        return groups[0].replace("t0", dst, 1) + "\n"
    out = " ".join(groups) + "\n"
    if len(groups) == 2:
        return out + f"lop3.b32 {dst}, t0, t1, m, 0xD8;\n"
    return out + (
        "lop3.b32 t0, t0, t1, m, 0xD8; lop3.b32 t2, t2, t3, m, 0xD8;"
        f" lop3.b32 {dst}, t0, t2, m4, 0xD8;\n"
    )


def codebook_word_asm(table: tuple[int, ...], dtype: torch.dtype) -> str:
    """Inline PTX for `mxfp4.triton.wgmma`'s ``DECODE``: the lane's 8 fields (``$4``: a word of
    8 nibbles at K = 4, 5, or 8 2-bit fields in its low 16 bits at K = 2, 3; at K = 3, 5 their
    1-bit fields in the low byte of ``$12``) under its E4M4 byte (``$20`` at K = 3, 5, else
    ``$12``) into the pairs of values (0, 1), (2, 3), (4, 5), (6, 7) in ``$0..$3`` (`dtype`
    fp16 or bf16), with `table` from `table_words` (its size gives K)."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"kbit wgmma: activations must be fp16 or bf16, got {dtype}")
    bits = _TABLE_BITS.get(len(table))
    if bits is None:
        raise ValueError(f"kbit wgmma: a table of 2, 4, 8 or 16 registers, got {len(table)}")
    sc_op = f"${SCALE_WITH_ONES if bits in (3, 5) else SCALE}"
    lo, hi = table[: len(table) // 2], table[len(table) // 2 :]
    if dtype == torch.float16:
        scale = f"prmt.b32 sc, {sc_op}, 0, 0x4040; shl.b32 sc, sc, 6;\n"
        fma = "fma.rn.f16x2"
    else:  # the fp16 of absmax / 16 to float32, whose top half is its bf16 (exact)
        scale = (
            f"shl.b32 sc, {sc_op}, 6; mov.b32 {{h, hx}}, sc; cvt.f32.f16 f, h; mov.b32 sc, f;"
            " prmt.b32 sc, sc, 0, 0x3232;\n"
        )
        fma = "fma.rn.bf16x2"
    # the two pairs of a part, output registers to .format
    pairs = (
        f"prmt.b32 l1, l0, h0, {_PAIR_SELECTORS[0]:#x}; {fma} ${{}}, l1, sc, nz;\n"
        f"prmt.b32 h1, l0, h0, {_PAIR_SELECTORS[1]:#x}; {fma} ${{}}, h1, sc, nz;\n"
    )
    start = ""
    if bits in (3, 5):  # the 1-bit fields to bit 0 of 8 nibbles
        start += f"and.b32 o, ${ONES}, 0xff;\n" + "".join(
            f"shl.b32 m, o, {sh}; or.b32 o, o, m; and.b32 o, o, {mask:#x};\n"
            for sh, mask in _SPREAD_BITS
        )
    if bits >= 4:
        start += "shl.b32 a, w, 4;\n"
        if bits == 5:
            start += "shl.b32 o7, o, 7; shl.b32 o3, o, 3;\n"
    else:
        start += "and.b32 a, w, 0xffff;\n" + "".join(
            f"shl.b32 m, a, {sh}; or.b32 a, a, m; and.b32 a, a, {mask:#x};\n"
            for sh, mask in _SPREAD
        )
        if bits == 3:
            start += "shl.b32 o, o, 2; or.b32 a, a, o;\n"
    body = []
    for part, sel in enumerate(_MASK_SELECTORS):
        if bits >= 4:
            shift = "mov.b32 s, w;" if part == 0 else "shr.b32 s, w, 16;"
            sel_asm = f"{shift} and.b32 s, s, 0x7777; prmt.b32 m, a, w, {sel:#x};"
            if bits == 5:
                sel_asm += f" prmt.b32 m4, o7, o3, {sel:#x};"
        else:
            sel_asm = "mov.b32 s, a;" if part == 0 else "shr.b32 s, a, 16;"
        body.append(
            sel_asm + "\n" + _lookup_asm("l0", lo) + _lookup_asm("h0", hi)
            + pairs.format(2 * part, 2 * part + 1)
        )  # fmt: skip
    return (
        "{ .reg .b32 w, a, s, m, m4, o, o7, o3, t0, t1, t2, t3, l0, l1, h0, h1, sc, nz;"
        " .reg .b16 h, hx; .reg .f32 f;\n"
        f"mov.b32 w, ${WORD}; mov.b32 nz, 0x80008000;\n" + start + scale + "".join(body) + "}"
    )


def decode_asm(weight: KbitWeight, dtype: torch.dtype) -> str:
    """`codebook_word_asm` of `weight`'s codebook, built on first use (the codebook is read on
    the host once, at warm-up) and kept with the weight."""
    cache = weight.__dict__.setdefault("_wgmma_decode", {})
    asm = cache.get(dtype)
    if asm is None:
        asm = cache[dtype] = codebook_word_asm(table_words(weight.codebook, dtype), dtype)
    return asm


def kbit_wgmma_matmul(
    x2: torch.Tensor,
    weight: KbitWeight,
    bias: torch.Tensor | None,
    block_tokens: int,
    stages: int,
    chunk: int | None = None,
) -> torch.Tensor:
    """``x2 [M, K] @ W.T (+ bias)`` for a kbit `weight` on sm_90 (x2 fp16 or bf16): x copied
    into the kernel's k order (`mxfp4.triton.wgmma.input_order`), then one launch."""
    from quantfw.kernels.mxfp4.triton import wgmma

    return wgmma.dense_gemm(
        wgmma.input_order(x2), weight.qweight, weight.scales, weight.out_features,
        decode_asm(weight, x2.dtype), bias=bias, block_tokens=block_tokens, stages=stages,
        chunk=chunk, owner=weight, words_per_block=weight.bits,
    )  # fmt: skip
