"""The tiled GEMM layout of a kbit weight, the reference repack into it, and its CPU twin.

A linear weight ``W [N, K]`` (N output, K input features) quantized in blocks of 32 along K has
flat checkpoint tensors ``planes int32 [N, K/32, bits]`` and ``absmax uint8 [N, K/32]``
(`format.quantize`). The kernels read it tiled so that a (k tile, n tile) region is
contiguous (spec 003, section 4.2), with ``TILE_K = 64`` (two blocks) and ``TILE_N = 128``::

    qweight[kt, nt, c, j, b] = planes[nt * TILE_N + c, kt * 2 + j, b]   int32 [KT, NT, 128, 2, bits]
    scales [kt, nt, c, j]    = absmax[nt * TILE_N + c, kt * 2 + j]      uint8 [KT, NT, 128, 2]

N is padded to a multiple of 128 and K to a multiple of 64 with zero blocks (absmax 0, so
zero weights); ``in_features`` / ``out_features`` keep the true sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from quantfw.kernels.kbit import format as kfmt

TILE_K = 64
TILE_N = 128
BLOCKS_PER_TILE = TILE_K // kfmt.BLOCKSIZE


@dataclass
class KbitWeight:
    """A kbit weight in the kernels' tiled layout (see module docstring)."""

    qweight: torch.Tensor  # int32 [KT, NT, TILE_N, 2, bits]
    scales: torch.Tensor  # uint8 [KT, NT, TILE_N, 2] (E4M4)
    codebook: torch.Tensor  # float32 [2**bits]
    in_features: int
    out_features: int

    @property
    def bits(self) -> int:
        return self.qweight.shape[-1]

    def to(self, device) -> KbitWeight:
        return replace(
            self,
            qweight=self.qweight.to(device),
            scales=self.scales.to(device),
            codebook=self.codebook.to(device),
        )


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def tiled_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """(KT, NT): the number of k tiles and n tiles of a ``[out, in]`` weight."""
    return _round_up(in_features, TILE_K) // TILE_K, _round_up(out_features, TILE_N) // TILE_N


def tiled_nbytes(out_features: int, in_features: int, bits: int) -> int:
    """Bytes of ``qweight`` + ``scales`` + ``codebook`` of a ``[out, in]`` weight."""
    kt, nt = tiled_shape(out_features, in_features)
    blocks = kt * nt * TILE_N * BLOCKS_PER_TILE
    return blocks * (4 * bits + 1) + 4 * (1 << bits)


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


def repack(
    planes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, name: str = "kbit weight"
) -> KbitWeight:
    """Flat ``planes [N, K/32, bits]`` and ``absmax [N, K/32]`` -> the tiled `KbitWeight`
    (torch ops on the tensors' device: the reference the Triton repack is checked against)."""
    n, kb, bits, cb = check_flat(planes, absmax, codebook, name)
    kt, nt = tiled_shape(n, kb * kfmt.BLOCKSIZE)
    pad_n, pad_kb = nt * TILE_N - n, kt * BLOCKS_PER_TILE - kb
    planes = F.pad(planes, (0, 0, 0, pad_kb, 0, pad_n))
    absmax = F.pad(absmax, (0, pad_kb, 0, pad_n))
    q = planes.reshape(nt, TILE_N, kt, BLOCKS_PER_TILE, bits).permute(2, 0, 1, 3, 4)
    s = absmax.reshape(nt, TILE_N, kt, BLOCKS_PER_TILE).permute(2, 0, 1, 3)
    return KbitWeight(q.contiguous(), s.contiguous(), cb, kb * kfmt.BLOCKSIZE, n)


def unpack(weight: KbitWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat ``(planes [N, K/32, bits], absmax [N, K/32])`` of a tiled weight."""
    kt, nt, tn, bpt, bits = weight.qweight.shape
    n, kb = weight.out_features, weight.in_features // kfmt.BLOCKSIZE
    planes = weight.qweight.permute(1, 2, 0, 3, 4).reshape(nt * tn, kt * bpt, bits)
    absmax = weight.scales.permute(1, 2, 0, 3).reshape(nt * tn, kt * bpt)
    return planes[:n, :kb], absmax[:n, :kb]


def dequantize_weight(weight: KbitWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``[N, K]`` weight, computed from the tiled layout."""
    planes, absmax = unpack(weight)
    return kfmt.dequantize(planes, absmax, weight.codebook, dtype)
