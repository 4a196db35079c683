"""kbit K = 2 and 4 through the Hopper wgmma kernel of `mxfp4.triton.wgmma` (batches of 17 or
more tokens on sm_90; by default in calls made for CUDA graphs, `triton.dispatch`): the
field-packed K = 4 layout is MXFP4's runtime layout byte for byte and K = 2's has the same
quads with 2 words a block, so only the decode of the 8 fields a lane takes differs, given here
as inline PTX.

The levels, as ``16 * level`` in the activation dtype, are split into their low and high bytes
(K = 4: four registers each, entries ``4 i .. 4 i + 3`` in register i; K = 2: one each), which
become immediates of the PTX, so the kernel is compiled once per codebook and dtype. ``prmt``
picks bytes by 4-bit selectors, four at a time:

* K = 4 (a word of 8 nibbles, element ``8 c + t`` at bits ``4 t``; the low, then the high 16
  bits): one ``prmt`` per register pair looks up the bytes among entries 0..7 and another
  among 8..15 (``prmt`` selects with 3 bits), a ``prmt`` in sign-replicate mode turns each
  index's bit 3 into a byte mask, and ``lop3`` picks between the two lookups;
* K = 2 (the lane's 16 bits of 2-bit fields: the kernel shifts word ``c // 2`` by
  ``16 (c % 2)``): three shift-or-mask steps spread the fields to nibbles, and one ``prmt``
  per byte register looks them up.

Two ``prmt`` then pair low and high bytes into values, and each pair is multiplied by the E4M4
scale: its byte shifted left by 6 is the fp16 of ``absmax / 16`` (exact, subnormals included;
for bf16 converted through float32, exact), so a value is ``16 * level`` (rounded to the dtype)
times ``absmax / 16``, rounded once. `codebook_words` is the same algorithm in torch, the CPU
check of the PTX.
"""

from __future__ import annotations

import torch

from quantfw.kernels.kbit.configs import WGMMA_BITS
from quantfw.kernels.kbit.layout import KbitWeight

#: K = 4: prmt selectors: each index's bit 3 (bit 7 of a byte of ``w << 4`` or ``w``)
#: replicated over its output byte, for indices 0..3 and 4..7 of the word
_MASK_SELECTORS = (0xD9C8, 0xFBEA)
#: K = 2: 16 bits of 2-bit fields spread to 8 nibbles, (shift, mask) per step
_SPREAD = ((8, 0x00FF00FF), (4, 0x0F0F0F0F), (2, 0x33333333))
#: prmt selectors pairing low (a) and high (b) bytes into values (0, 1) and (2, 3)
_PAIR_SELECTORS = (0x5140, 0x7362)


def table_words(codebook: torch.Tensor, dtype: torch.dtype) -> tuple[int, ...]:
    """The registers of the lookup: low bytes of ``16 * codebook`` in `dtype`, entries ``4 i
    .. 4 i + 3`` in register i, then their high bytes (8 registers for 16 levels, 2 for 4)."""
    n = codebook.numel()
    if n not in (4, 16):
        raise ValueError(f"kbit wgmma: a codebook of 4 or 16 levels (K = 2 or 4), got {n}")
    half = (16 * codebook.detach().cpu().to(torch.float32)).to(dtype).view(torch.int16)
    half = [int(v) & 0xFFFF for v in half.tolist()]
    words = []
    for shift in (0, 8):
        for i in range(n // 4):
            words.append(sum(((half[4 * i + b] >> shift) & 0xFF) << (8 * b) for b in range(4)))
    return tuple(words)


def codebook_word_asm(table: tuple[int, ...], dtype: torch.dtype) -> str:
    """Inline PTX for `mxfp4.triton.wgmma`'s ``DECODE``: the lane's 8 fields (``$4``: a word of
    8 nibbles, or 8 2-bit fields in its low 16 bits, by the size of `table`) under its E4M4
    byte ``$12`` into the pairs of values (0, 1), (2, 3), (4, 5), (6, 7) in ``$0..$3``
    (`dtype` fp16 or bf16), with `table` from `table_words`."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"kbit wgmma: activations must be fp16 or bf16, got {dtype}")
    if len(table) not in (2, 8):
        raise ValueError(f"kbit wgmma: a table of 2 or 8 registers, got {len(table)}")
    lo, hi = table[: len(table) // 2], table[len(table) // 2 :]
    if dtype == torch.float16:
        scale = "prmt.b32 sc, $12, 0, 0x4040; shl.b32 sc, sc, 6;\n"
        fma = "fma.rn.f16x2"
    else:  # the fp16 of absmax / 16 to float32, whose top half is its bf16 (exact)
        scale = (
            "shl.b32 sc, $12, 6; mov.b32 {h, hx}, sc; cvt.f32.f16 f, h; mov.b32 sc, f;"
            " prmt.b32 sc, sc, 0, 0x3232;\n"
        )
        fma = "fma.rn.bf16x2"
    # the two pairs of a part, output registers to .format
    pairs = (
        f"prmt.b32 l1, l0, h0, {_PAIR_SELECTORS[0]:#x}; {fma} ${{}}, l1, sc, nz;\n"
        f"prmt.b32 h1, l0, h0, {_PAIR_SELECTORS[1]:#x}; {fma} ${{}}, h1, sc, nz;\n"
    )
    body = []
    if len(table) == 8:
        start = "shl.b32 a, w, 4;\n"
        for part, sel in enumerate(_MASK_SELECTORS):
            shift = "mov.b32 s, w;" if part == 0 else "shr.b32 s, w, 16;"
            body.append(
                f"{shift} and.b32 s, s, 0x7777; prmt.b32 m, a, w, {sel:#x};\n"
                f"prmt.b32 l0, {lo[0]:#x}, {lo[1]:#x}, s; prmt.b32 l1, {lo[2]:#x}, {lo[3]:#x}, s;"
                " lop3.b32 l0, l0, l1, m, 0xD8;\n"
                f"prmt.b32 h0, {hi[0]:#x}, {hi[1]:#x}, s; prmt.b32 h1, {hi[2]:#x}, {hi[3]:#x}, s;"
                " lop3.b32 h0, h0, h1, m, 0xD8;\n" + pairs.format(2 * part, 2 * part + 1)
            )
    else:
        start = "and.b32 a, w, 0xffff;\n" + "".join(
            f"shl.b32 m, a, {sh}; or.b32 a, a, m; and.b32 a, a, {mask:#x};\n"
            for sh, mask in _SPREAD
        )
        for part in range(2):
            shift = "mov.b32 s, a;" if part == 0 else "shr.b32 s, a, 16;"
            body.append(
                f"{shift} prmt.b32 l0, {lo[0]:#x}, 0, s; prmt.b32 h0, {hi[0]:#x}, 0, s;\n"
                + pairs.format(2 * part, 2 * part + 1)
            )
    return (
        "{ .reg .b32 w, a, s, m, l0, l1, h0, h1, sc, nz; .reg .b16 h, hx; .reg .f32 f;\n"
        "mov.b32 w, $4; mov.b32 nz, 0x80008000;\n" + start + scale + "".join(body) + "}"
    )


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """PTX ``prmt.b32`` (default mode) on int64 tensors holding 32-bit values."""
    src = torch.stack([(v >> (8 * i)) & 0xFF for v in (a, b) for i in range(4)], -1)
    out = torch.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src.gather(-1, (nib & 7).unsqueeze(-1)).squeeze(-1)
        byte = torch.where(nib >= 8, torch.where(byte >= 0x80, 0xFF, 0), byte)
        out |= byte << (8 * i)
    return out


def codebook_words(
    words: torch.Tensor, scale_bytes: torch.Tensor, codebook: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`codebook_word_asm` in torch: int64 `words` (8 indices each: nibbles at K = 4, 2-bit
    fields in the low 16 bits at K = 2) under E4M4 `scale_bytes` (same shape) -> ``[..., 8]``
    values in `dtype`, in the fields' order."""
    table = torch.tensor(table_words(codebook, dtype), dtype=torch.int64)
    w = words & 0xFFFFFFFF

    def const(i: int) -> torch.Tensor:
        return table[i].expand_as(w)

    def sel(v: int) -> torch.Tensor:
        return torch.full_like(w, v)

    half = (scale_bytes.to(torch.int64) << 6).to(torch.int16).view(torch.float16)
    scale = half.to(torch.float64)  # absmax / 16, exact
    parts = []
    if len(table) == 8:
        for part, mask_sel in enumerate(_MASK_SELECTORS):
            s = ((w >> 16 * part) & 0x7777).expand_as(w)
            m = _prmt((w << 4) & 0xFFFFFFFF, w, sel(mask_sel))
            lo = (_prmt(const(0), const(1), s) & ~m) | (_prmt(const(2), const(3), s) & m)
            hi = (_prmt(const(4), const(5), s) & ~m) | (_prmt(const(6), const(7), s) & m)
            parts.append((lo, hi))
    else:
        a = w & 0xFFFF
        for sh, mask in _SPREAD:
            a = (a | (a << sh)) & mask
        for part in range(2):
            s = (a >> (16 * part)).expand_as(w)
            zero = torch.zeros_like(w)
            parts.append((_prmt(const(0), zero, s), _prmt(const(1), zero, s)))
    values = []
    for lo, hi in parts:
        for pair_sel in _PAIR_SELECTORS:
            pair = _prmt(lo, hi, sel(pair_sel))
            for h in (0, 1):
                bits = ((pair >> (16 * h)) & 0xFFFF).to(torch.int16)
                level = bits.view(dtype).to(torch.float64)
                values.append((level * scale).to(dtype))  # exact product, rounded once
    return torch.stack(values, -1)


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
    """``x2 [M, K] @ W.T (+ bias)`` for a K = 2 or 4 `weight` on sm_90 (x2 fp16 or bf16): x
    copied into the kernel's k order (`mxfp4.triton.wgmma.input_order`), then one launch."""
    from quantfw.kernels.mxfp4.triton import wgmma

    if weight.bits not in WGMMA_BITS:
        raise ValueError(f"kbit wgmma: K = 2 or 4 weights only, got K = {weight.bits}")
    return wgmma.dense_gemm(
        wgmma.input_order(x2), weight.qweight, weight.scales, weight.out_features,
        decode_asm(weight, x2.dtype), bias=bias, block_tokens=block_tokens, stages=stages,
        chunk=chunk, owner=weight, words_per_block=weight.bits,
    )  # fmt: skip
