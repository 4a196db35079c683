"""The field-packed GEMM layout of a kbit weight, the reference repack into it, and its CPU twin.

A linear weight ``W [N, K]`` (N output, K input features) quantized in blocks of 32 along K has
flat checkpoint tensors ``planes int32 [N, K/32, bits]`` (bit ``l`` of word ``b`` = bit ``b``
of element ``l``'s index) and ``absmax uint8 [N, K/32]`` (`format.quantize`). Bit planes cost
one shift and mask per bit and element to decode; the kernels instead read *field groups*, in
which one shift and one mask extract an element's field. Per (column, block) there are still
exactly ``bits`` int32 words (the same bytes as the planes), in groups of ``f``-bit fields:

=====  ============================================  ==========================
bits   groups, in order (words)                      index
=====  ============================================  ==========================
2      2-bit (2 words)                               ``f2``
3      2-bit (2 words), 1-bit (1 word)               ``f2 | f1 << 2``
4      4-bit (4 words)                               ``f4``
5      4-bit (4 words), 1-bit (1 word)               ``f4 | f1 << 4``
=====  ============================================  ==========================

In an ``f``-bit group, word ``j`` holds elements ``(32 / f) * j + t`` at bits ``f*t ..
f*t + f - 1`` (``t < 32 / f``): a kernel that extracts a ``[words, 32 / f]`` tile from a group
and flattens it gets the block's elements in order. Storage::

    qweight int32 [N_pad, KB_pad * bits]   row n: column n's blocks in quads of 4 (``QUAD``);
                                           word j (group order) of block 4 q + r at
                                           4 bits q + 4 j + r
    scales  uint8 [N_pad, KB_pad]          E4M4 absmax of (column, block)
    codebook float32 [2**bits]

The quad interleave puts word j of 4 consecutive blocks side by side, so the mma kernel's lane
that takes word j of a block reads it for 4 blocks with one 16-byte load (`block_words` undoes
it). ``N_pad`` is N rounded up to ``PAD_N = 128`` and ``KB_pad * 32`` is K rounded up to ``PAD_K =
256`` (the largest kernel ``block_k``) with zero blocks (absmax 0, so zero weights), so the
kernels' weight loads need no masks; ``in_features`` / ``out_features`` keep the true sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from quantfw.kernels.kbit import format as kfmt

PAD_N = 128
PAD_K = 256
#: blocks whose words are interleaved word by word (divides PAD_K / 32)
QUAD = 4

#: per bits: the field groups in storage order, as (field bits = words, first index bit)
FIELD_GROUPS: dict[int, tuple[tuple[int, int], ...]] = {
    2: ((2, 0),),
    3: ((2, 0), (1, 2)),
    4: ((4, 0),),
    5: ((4, 0), (1, 4)),
}


@dataclass
class KbitWeight:
    """A kbit weight in the kernels' field-packed layout (see module docstring)."""

    qweight: torch.Tensor  # int32 [N_pad, KB_pad * bits]
    scales: torch.Tensor  # uint8 [N_pad, KB_pad] (E4M4)
    codebook: torch.Tensor  # float32 [2**bits]
    in_features: int
    out_features: int

    @property
    def bits(self) -> int:
        return self.qweight.shape[1] // self.scales.shape[1]

    @property
    def padded_blocks(self) -> int:
        """KB_pad: blocks of 32 per column, padding included."""
        return self.scales.shape[1]

    def to(self, device) -> KbitWeight:
        return replace(
            self,
            qweight=self.qweight.to(device),
            scales=self.scales.to(device),
            codebook=self.codebook.to(device),
        )


#: the row interleave of a gated pair (`fused.interleave_gate_up`) whose activation the mma
#: kernel computes in its epilogue: gate and up each half of a 64-column block
GATED_GROUP = 32


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def padded_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """(N_pad, KB_pad) of a ``[out, in]`` weight."""
    return _round_up(out_features, PAD_N), _round_up(in_features, PAD_K) // kfmt.BLOCKSIZE


def tiled_nbytes(out_features: int, in_features: int, bits: int) -> int:
    """Bytes of ``qweight`` + ``scales`` + ``codebook`` of a ``[out, in]`` weight."""
    n_pad, kb_pad = padded_shape(out_features, in_features)
    return n_pad * kb_pad * (4 * bits + 1) + 4 * (1 << bits)


def check_flat(
    planes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, name: str
) -> tuple[int, int, int, torch.Tensor]:
    """(N, K/32, bits, float32 codebook on the planes' device) of flat checkpoint tensors that
    fit together; a ValueError naming `name` otherwise."""
    if planes.dim() != 3:
        raise ValueError(f"{name}: kbit_planes are [out, in/32, bits], got {list(planes.shape)}")
    n, kb, bits = planes.shape
    kfmt.check_shapes(planes, absmax, bits, name)
    cb = kfmt.check_codebook(codebook, bits, f"{name} codebook").to(planes.device)
    return n, kb, bits, cb


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 uint32 bit patterns -> int32 (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_fields(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """Indices ``[..., 32]`` -> int32 words ``[..., bits]`` of one block in group order."""
    idx = indices.to(torch.int64)
    words = []
    for f, low in FIELD_GROUPS[bits]:
        field = ((idx >> low) & ((1 << f) - 1)).reshape(*idx.shape[:-1], f, 32 // f)
        shifts = torch.arange(0, 32, f, device=idx.device)
        words.append((field << shifts).sum(-1))
    return _as_int32(torch.cat(words, dim=-1))


def unpack_fields(words: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., bits]`` in group order -> indices int64 ``[..., 32]``."""
    bits = words.shape[-1]
    w = words.to(torch.int64) & 0xFFFFFFFF
    idx = torch.zeros(*w.shape[:-1], kfmt.BLOCKSIZE, dtype=torch.int64, device=w.device)
    start = 0
    for f, low in FIELD_GROUPS[bits]:
        shifts = torch.arange(0, 32, f, device=w.device)
        field = (w[..., start : start + f, None] >> shifts) & ((1 << f) - 1)
        idx |= field.reshape(idx.shape) << low
        start += f
    return idx


def interleave_quads(words: torch.Tensor) -> torch.Tensor:
    """Block-major words ``[N, KB_pad, bits]`` -> ``qweight [N, KB_pad * bits]`` (word j of
    block 4 q + r at ``4 bits q + 4 j + r``)."""
    n, kbp, bits = words.shape
    quads = words.reshape(n, kbp // QUAD, QUAD, bits).transpose(2, 3)
    return quads.reshape(n, kbp * bits).contiguous()


def block_words(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """``qweight [N, KB_pad * bits]`` -> its words per block, ``[N, KB_pad, bits]``."""
    n = qweight.shape[0]
    kbp = qweight.shape[1] // bits
    return qweight.reshape(n, kbp // QUAD, bits, QUAD).transpose(2, 3).reshape(n, kbp, bits)


def repack(
    planes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, name: str = "kbit weight"
) -> KbitWeight:
    """Flat ``planes [N, K/32, bits]`` and ``absmax [N, K/32]`` -> the field-packed
    `KbitWeight` (torch ops on the tensors' device: the reference the Triton repack is checked
    against)."""
    n, kb, bits, cb = check_flat(planes, absmax, codebook, name)
    n_pad, kb_pad = padded_shape(n, kb * kfmt.BLOCKSIZE)
    words = pack_fields(kfmt.unpack_bitplanes(planes), bits)  # [N, KB, bits]
    words = F.pad(words, (0, 0, 0, kb_pad - kb, 0, n_pad - n))
    scales = F.pad(absmax, (0, kb_pad - kb, 0, n_pad - n))
    return KbitWeight(
        interleave_quads(words),
        scales.contiguous(),
        cb,
        kb * kfmt.BLOCKSIZE,
        n,
    )


def _fields(weight: KbitWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64 [N, K/32, 32], absmax [N, K/32]) of the unpadded weight."""
    n, kb, bits = weight.out_features, weight.in_features // kfmt.BLOCKSIZE, weight.bits
    words = block_words(weight.qweight[:n], bits)[:, :kb]
    return unpack_fields(words), weight.scales[:n, :kb]


def unpack(weight: KbitWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat ``(planes [N, K/32, bits], absmax [N, K/32])`` of a field-packed weight."""
    indices, absmax = _fields(weight)
    return kfmt.pack_bitplanes(indices, weight.bits), absmax


def dequantize_weight(weight: KbitWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``[N, K]`` weight, computed from the field-packed layout (as
    `format.dequantize`: level times decoded scale in float32, then `dtype`)."""
    indices, absmax = _fields(weight)
    cb = weight.codebook.to(device=indices.device, dtype=torch.float32)
    values = cb[indices] * kfmt.decode_e4m4(absmax).unsqueeze(-1)
    return values.reshape(weight.out_features, weight.in_features).to(dtype)
