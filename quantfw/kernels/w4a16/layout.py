"""The W4A16 packed layout: repacking AWQ / GPTQ checkpoint tensors into it, and its CPU twin.

Pure tensor functions, no Triton. A quantization method calls, once at load time,

    packed = repack_awq(qweight, qzeros, scales, group_size)
    packed = repack_gptq(qweight, qzeros, scales, g_idx, group_size, sym, checkpoint_format)

and ``w4a16_matmul`` (matmul.py) per forward. ``dequantize_packed`` reads the very same packed
layout back: the CPU twin of every layout transform.

Packed layout (see docs/kernels-w4a16.md and quantfw/kernels/w4a16/triton/mma.py): the words
are arranged so that each GPU lane's 128-bit load holds exactly the ``mma.m16n8k16`` fragment
nibbles it needs (``pack_mma``; a word is the B fragment of two 8-column tiles, or equally the
A fragment of one 16-column tile, which is how the kernel uses it), and scale + zero of a column share one 32-bit word in the
activation dtype (``pack_mma_scales``).  K and N are padded to multiples of 16 and 64 with zero
weights; ``in_features``/``out_features`` keep the true sizes.
``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``, ``out = x[:, perm] @ w`` where ``perm`` is
the act-order row permutation (None when rows are already in group order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

PACK = 8
# nibble position of column j inside its 32-bit word (AutoAWQ order)
NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)

__all__ = [
    "MMA_BLOCK_K",
    "MMA_BLOCK_N",
    "NIBBLE_OF",
    "PackedW4",
    "repack_awq",
    "repack_gptq",
    "dequantize_packed",
    "pack_mma",
    "unpack_mma",
    "pack_mma_scales",
    "unpack_mma_scales",
    "unpack_cols",
    "pack_cols",
    "unpack_rows",
]


@dataclass
class PackedW4:
    """A 4-bit weight in the kernels' layout (see module docstring)."""

    qweight: torch.Tensor  # int32 [ceil(N/64), ceil(K/16), 32, 4]  (pack_mma)
    scales_zeros: torch.Tensor  # int32 [n_groups, ceil(N/64), 8, 8], `dtype` halves
    group_size: int  # rows per group after any act-order sort (K when per-channel)
    in_features: int
    out_features: int
    perm: torch.Tensor | None = None  # int64 [K]: x columns to gather (act-order), or None
    dtype: torch.dtype = torch.float16  # activation dtype the scales_zeros halves are in

    @property
    def num_groups(self) -> int:
        return self.scales_zeros.shape[0]

    def scales_zeros_as(self, dtype: torch.dtype) -> torch.Tensor:
        """scales_zeros with both halves in the activation dtype `dtype` (converted per call
        when it is not the dtype the weight was packed for)."""
        if dtype == self.dtype:
            return self.scales_zeros
        s, z = unpack_mma_scales(self.scales_zeros, self.dtype)
        return pack_mma_scales(s, z, dtype)

    def to(self, device) -> PackedW4:
        return replace(
            self,
            qweight=self.qweight.to(device),
            scales_zeros=self.scales_zeros.to(device),
            perm=None if self.perm is None else self.perm.to(device),
        )


# ---------------------------------------------------------------------------------------------
# nibble helpers (plain torch; the CPU twin of the layout)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = NIBBLE_OF) -> torch.Tensor:
    """int32 [R, C/8] packed along columns -> uint8 [R, C].

    ``order[j]`` is the nibble holding column ``8c + j``; ``None`` means sequential (GPTQ zeros)."""
    order = order or tuple(range(PACK))
    shifts = torch.tensor([4 * p for p in order], dtype=torch.int32, device=packed.device)
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return q.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_cols(q: torch.Tensor, order: tuple[int, ...] | None = NIBBLE_OF) -> torch.Tensor:
    """uint8/int [R, C] values in 0..15 -> int32 [R, C/8] (inverse of unpack_cols)."""
    order = order or tuple(range(PACK))
    rows, cols = q.shape
    if cols % PACK:
        raise ValueError(f"pack_cols: {cols} columns is not a multiple of {PACK}")
    q = q.to(torch.int64).reshape(rows, cols // PACK, PACK)
    word = torch.zeros(rows, cols // PACK, dtype=torch.int64, device=q.device)
    for j, p in enumerate(order):
        word |= (q[..., j] & 0xF) << (4 * p)
    return _u32_to_i32(word)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight int32 [K/8, N] (nibble i of word [r, n] = row 8r+i) -> uint8 [K, N]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = (packed.to(torch.int32).unsqueeze(1) >> shifts.view(1, PACK, 1)) & 0xF
    return q.reshape(-1, packed.shape[1]).to(torch.uint8)


def _u32_to_i32(word: torch.Tensor) -> torch.Tensor:
    word = word & 0xFFFFFFFF
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


# ---------------------------------------------------------------------------------------------
# repacking (once, at load)


def _check_2d(name: str, t: torch.Tensor, shape: tuple[int, int], dtype=None) -> None:
    if t.dim() != 2 or tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def repack_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float16,
) -> PackedW4:
    """AWQ (GEMM format) checkpoint tensors -> PackedW4 for activations in `dtype`.

    qweight int32 [K, N/8] and qzeros int32 [K/G, N/8] packed along N in AutoAWQ's nibble order,
    scales fp16 [K/G, N]; w = (q - z) * s.  The nibbles are unpacked and rearranged into mma
    fragments (pack_mma); the int4 memory stays the same."""
    K, n8 = qweight.shape
    N = n8 * PACK
    G = K if group_size in (-1, 0, None) else int(group_size)
    ng = math.ceil(K / G)
    _check_2d("awq qweight", qweight, (K, n8), torch.int32)
    _check_2d("awq qzeros", qzeros, (ng, n8), torch.int32)
    _check_2d("awq scales", scales, (ng, N))
    return _pack(unpack_cols(qweight), unpack_cols(qzeros), scales, G, None, dtype)


def repack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    dtype: torch.dtype = torch.float16,
) -> PackedW4:
    """GPTQ checkpoint tensors -> PackedW4 for activations in `dtype`.

    qweight int32 [K/8, N] packed along K (nibble i of word [r, n] = row 8r+i), qzeros int32
    [n_groups, N/8] packed along N in sequential order, holding z-1 for ``checkpoint_format``
    "gptq" (v1) and z for "gptq_v2"; scales [n_groups, N]; g_idx [K] maps each input row to its
    group.  With act-order (g_idx not monotone) rows are sorted by group once here and the
    permutation is kept in ``perm`` (the activations' columns are gathered with it per call).
    ``sym`` with ``qzeros=None`` means z = 8."""
    if checkpoint_format not in ("gptq", "gptq_v1", "gptq_v2"):
        raise ValueError(
            f"repack_gptq: checkpoint_format {checkpoint_format!r} is not one of "
            "'gptq' (v1, zeros stored minus one), 'gptq_v2'"
        )
    k8, N = qweight.shape
    K = k8 * PACK
    _check_2d("gptq qweight", qweight, (k8, N), torch.int32)
    G = K if group_size in (-1, 0, None) else int(group_size)
    ng = scales.shape[0]
    _check_2d("gptq scales", scales, (ng, N))
    dev = qweight.device

    q = unpack_rows(qweight)  # [K, N]
    if qzeros is None:
        if not sym:
            raise ValueError("repack_gptq: asymmetric GPTQ needs qzeros")
        z = torch.full((ng, N), 8, dtype=torch.int32, device=dev)
    else:
        _check_2d("gptq qzeros", qzeros, (ng, N // PACK), torch.int32)
        z = unpack_cols(qzeros, None).to(torch.int32)
        if checkpoint_format in ("gptq", "gptq_v1"):
            z = z + 1
            if bool((z > 15).any()):
                raise ValueError(
                    "repack_gptq: a v1 zero point is 16 (stored 15 + 1), which a 4-bit packed "
                    "zero cannot hold; convert the checkpoint to gptq_v2"
                )

    if g_idx is None:
        g = torch.arange(K, device=dev) // G
    else:
        g = g_idx.to(device=dev, dtype=torch.int64).reshape(-1)
        if g.numel() != K:
            raise ValueError(f"repack_gptq: g_idx has {g.numel()} entries, qweight has {K} rows")
        if bool(((g < 0) | (g >= ng)).any()):
            raise ValueError(f"repack_gptq: g_idx values outside [0, {ng})")

    perm = None
    if bool((g[1:] < g[:-1]).any()):  # act-order: sort rows by group, once
        perm = torch.sort(g, stable=True).indices
        q = q[perm]
        g = g[perm]

    # group runs are now contiguous; find the largest chunk size that every run boundary respects
    starts = (torch.nonzero(g[1:] != g[:-1]).flatten() + 1).tolist()
    geff = 0
    for s in starts:
        geff = math.gcd(geff, s)
    geff = K if geff == 0 else geff
    n_chunks = math.ceil(K / geff)
    chunk_group = g[torch.arange(n_chunks, device=dev) * geff]
    # every row of a chunk must share its group (true by construction of geff)
    return _pack(q, z[chunk_group], scales[chunk_group], geff, perm, dtype)


def _pack(
    q: torch.Tensor,
    z: torch.Tensor,
    scales: torch.Tensor,
    G: int,
    perm: torch.Tensor | None,
    dtype: torch.dtype,
) -> PackedW4:
    """q [K, N], z / scales [n_groups, N] -> PackedW4, padding K to 16 and N to 64; scales are
    rounded to fp16 (the checkpoints' dtype), then stored in the activation dtype `dtype`."""
    K, N = q.shape
    kp, np_ = -K % MMA_BLOCK_K, -N % MMA_BLOCK_N
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, np_, 0, kp))
    z = torch.nn.functional.pad(z.to(torch.int32), (0, np_))
    scales = torch.nn.functional.pad(scales.to(torch.float16), (0, np_))
    return PackedW4(pack_mma(q), pack_mma_scales(scales, z, dtype), G, K, N, perm, dtype)


# ---------------------------------------------------------------------------------------------
# the CPU twin: dequantize the packed layout


def dequantize_packed(packed: PackedW4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[K, N] weight in the packed (sorted) row order, computed from the packed layout."""
    K, N = packed.in_features, packed.out_features
    q = unpack_mma(packed.qweight)[:K, :N].to(torch.float32)
    s, z = unpack_mma_scales(packed.scales_zeros, packed.dtype)
    rows = torch.arange(K, device=q.device) // packed.group_size
    return ((q - z[rows, :N]) * s[rows, :N]).to(dtype)


# ---------------------------------------------------------------------------------------------
# the mma-fragment layout of the small-M Gluon kernel (quantfw/kernels/w4a16/triton/mma.py)

MMA_BLOCK_N = 64  # output columns per block: 4 words x 2 mma tiles of 8 columns per lane
MMA_BLOCK_K = 16  # k per mma step
_MAGIC = {torch.float16: 1024.0, torch.bfloat16: 128.0}


def _mma_views(K: int, N: int) -> None:
    if N % MMA_BLOCK_N or K % MMA_BLOCK_K:
        raise ValueError(
            f"mma layout: needs N % {MMA_BLOCK_N} == 0 and K % {MMA_BLOCK_K} == 0, got K={K}, N={N}"
        )


def pack_mma(q: torch.Tensor) -> torch.Tensor:
    """uint8/int [K, N] values 0..15 -> int32 [N/64, K/16, 32, 4] (mma fragment words).

    Word ``[nb, kb, 4g + c, j]`` nibble ``s = 4h + 2t + e`` (bits ``4s``) holds
    ``q[16kb + 8e + 2c + h, 64nb + 16j + 8t + g]``."""
    K, N = q.shape
    _mma_views(K, N)
    v = q.to(torch.int64).reshape(K // 16, 2, 4, 2, N // 64, 4, 2, 8)  # kb e c h nb j t g
    v = v.permute(4, 0, 7, 2, 5, 3, 6, 1)  # nb kb g c j h t e
    v = v.reshape(N // 64, K // 16, 32, 4, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    return _u32_to_i32(((v & 0xF) << shifts).sum(-1))


def unpack_mma(qf: torch.Tensor) -> torch.Tensor:
    """int32 [N/64, K/16, 32, 4] -> uint8 [K, N] (inverse of pack_mma)."""
    nb, kb = qf.shape[:2]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qf.device)
    v = (qf.unsqueeze(-1) >> shifts) & 0xF  # nb kb lane j s
    v = v.reshape(nb, kb, 8, 4, 4, 2, 2, 2)  # nb kb g c j h t e
    v = v.permute(1, 7, 3, 5, 0, 4, 6, 2)  # kb e c h nb j t g
    return v.reshape(kb * 16, nb * 64).to(torch.uint8)


def pack_mma_scales(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scales [n_groups, N], zeros [n_groups, N] (0..15) -> int32 [n_groups, N/64, 8, 8].

    Entry ``[grp, nb, g, 2j + t]`` is column ``64nb + 16j + 8t + g``: the scale in ``dtype``
    (low 16 bits) and ``magic + zero`` in ``dtype`` (high 16 bits), magic = 1024 (fp16) or 128
    (bf16), the value a ``lop3`` with the magic exponent makes of a nibble."""
    if dtype not in _MAGIC:
        raise ValueError(f"mma layout: activation dtype must be fp16 or bf16, got {dtype}")
    ng, N = scales.shape
    s = scales.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    zm = (zeros.to(torch.float32) + _MAGIC[dtype]).to(dtype).view(torch.int16).to(torch.int64)
    word = s | ((zm & 0xFFFF) << 16)
    word = word.reshape(ng, N // 64, 4, 2, 8).permute(0, 1, 4, 2, 3)  # grp nb g j t
    return _u32_to_i32(word.reshape(ng, N // 64, 8, 8))


def unpack_mma_scales(
    sz: torch.Tensor, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [n_groups, N/64, 8, 8] with ``dtype`` halves -> (scales fp32, zeros int32) [n_groups, N]."""
    ng, nb = sz.shape[:2]
    half = torch.stack([sz & 0xFFFF, (sz >> 16) & 0xFFFF]).to(torch.int16).view(dtype)
    s = half[0].to(torch.float32)
    z = (half[1].to(torch.float32) - _MAGIC[dtype]).round().to(torch.int32)

    def columns(t):  # [grp, nb, g, 2j + t] -> column 64 nb + 16 j + 8 t + g
        return t.reshape(ng, nb, 8, 4, 2).permute(0, 1, 3, 4, 2).reshape(ng, nb * 64)

    return columns(s), columns(z)
