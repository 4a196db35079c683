"""Slow, obviously correct packing and dequantization for AWQ and GPTQ (tests and fallbacks).

Integer codes are int32 tensors holding values in ``[0, 2**bits)``. Packed tensors are int32.
Layouts (see docs/formats.md):

- GPTQ packs ``32 / bits`` codes per int32 along one dim as a little-endian bit stream: code
  ``k`` of a row sits at bit ``k * bits`` of the stream, so 3-bit codes straddle words.
- AWQ (GEMM) packs 8 4-bit codes per int32 along the output dim, interleaved: nibble ``i``
  (bits ``4i .. 4i+3``) of word ``c`` holds column ``8c + AWQ_PACK_ORDER[i]``.
"""

from __future__ import annotations

import torch

#: nibble i of an AWQ word holds logical column AWQ_PACK_ORDER[i] (AutoAWQ's packing order)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: logical column j of an AWQ word sits in nibble AWQ_UNPACK_ORDER[j]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

SUPPORTED_GPTQ_BITS = (2, 3, 4, 8)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def packed_size(n: int, bits: int) -> int:
    """Number of int32 words holding `n` codes of `bits` bits; `n * bits` must be a multiple of 32."""
    if (n * bits) % 32:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole int32 words")
    return n * bits // 32


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integer codes along `dim` into int32 words (GPTQ bit-stream order). Codes are taken
    modulo 2**bits (a v1 zero of -1 is stored as all ones)."""
    moved = codes.movedim(dim, -1).to(torch.int64) & ((1 << bits) - 1)
    n = moved.shape[-1]
    words = packed_size(n, bits)
    if 32 % bits == 0:
        per = 32 // bits
        shifts = torch.arange(per, dtype=torch.int64, device=codes.device) * bits
        lanes = moved.reshape(*moved.shape[:-1], words, per) << shifts
        out = lanes.sum(-1)
    else:
        bit_pos = torch.arange(bits, dtype=torch.int64, device=codes.device)
        stream = ((moved.unsqueeze(-1) >> bit_pos) & 1).reshape(*moved.shape[:-1], words, 32)
        out = (stream << torch.arange(32, dtype=torch.int64, device=codes.device)).sum(-1)
    return _to_int32(out).movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words along `dim` -> int32 codes in [0, 2**bits)."""
    moved = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    words = moved.shape[-1]
    n = words * 32 // bits
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        shifts = torch.arange(32 // bits, dtype=torch.int64, device=packed.device) * bits
        codes = ((moved.unsqueeze(-1) >> shifts) & mask).reshape(*moved.shape[:-1], n)
    else:
        stream = (moved.unsqueeze(-1) >> torch.arange(32, device=packed.device)) & 1
        stream = stream.reshape(*moved.shape[:-1], n, bits)
        codes = (stream << torch.arange(bits, device=packed.device)).sum(-1)
    return codes.to(torch.int32).movedim(-1, dim).contiguous()


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [rows, cols] -> AWQ words [rows, cols / 8] (interleaved nibble order)."""
    rows, cols = codes.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 columns per int32; {cols} columns is not a multiple of 8")
    grouped = codes.reshape(rows, cols // 8, 8)[..., list(AWQ_PACK_ORDER)]
    return pack_int32(grouped.reshape(rows, cols), 4, dim=1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ words [rows, cols / 8] -> 4-bit codes [rows, cols] in logical column order."""
    nibbles = unpack_int32(packed, 4, dim=1)
    rows, cols = nibbles.shape
    return nibbles.reshape(rows, cols // 8, 8)[..., list(AWQ_UNPACK_ORDER)].reshape(rows, cols)


def group_index(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """The group of each input row when groups are contiguous (-1: one group)."""
    rows = torch.arange(in_features, dtype=torch.int32, device=device)
    return torch.zeros_like(rows) if group_size == -1 else rows // group_size


def dequantize(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """W[k, n] = (codes[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n], in fp32, [in, out]."""
    g = g_idx.long()
    return (codes.float() - zeros.float()[g]) * scales.float()[g]


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """AWQ GEMM tensors -> fp32 weight [in, out]."""
    codes = unpack_awq(qweight)
    g_idx = group_index(codes.shape[0], group_size, codes.device)
    return dequantize(codes, unpack_awq(qzeros), scales, g_idx)


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    *,
    zero_offset: int,
) -> torch.Tensor:
    """GPTQ tensors -> fp32 weight [in, out]. `zero_offset` is 1 for the v1 format (stored
    zeros are one less than the real ones) and 0 for v2."""
    codes = unpack_int32(qweight, bits, dim=0)
    zeros = unpack_int32(qzeros, bits, dim=1) + zero_offset
    return dequantize(codes, zeros, scales, g_idx)
