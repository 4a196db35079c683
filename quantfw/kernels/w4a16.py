"""W4A16 (4-bit weight, 16-bit activation) matmul for AWQ and GPTQ checkpoints.

Pure tensor functions, no nn.Module.  A quantization method calls, once at load time,

    packed = repack_awq(qweight, qzeros, scales, group_size)
    packed = repack_gptq(qweight, qzeros, scales, g_idx, group_size, sym, checkpoint_format)

and then, per forward,

    out = w4a16_matmul(x, packed, bias)

which runs the Triton kernels on CUDA and, on CPU, a reference path (dequantize + matmul)
that reads the very same packed layout: the CPU twin of every layout transform.

Packed layout (see docs/kernels-w4a16.md):

* ``qweight``: int32 ``[K, N // 8]``; word ``[k, c]`` holds columns ``8c .. 8c+7`` of row ``k``;
  column ``8c + j`` sits in nibble ``NIBBLE_OF[j]`` with ``NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)``
  (AutoAWQ's order: nibbles ``j`` and ``j + 4`` of one word are columns ``2j`` and ``2j + 1``, so
  one ``lop3`` turns a word into an fp16/bf16 pair of adjacent columns).
* ``qzeros``: int32 ``[ceil(K / G), N // 8]``, same order, the true zero point (0..15).
* ``scales``: fp16 ``[ceil(K / G), N]``.
* ``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``, ``out = x[:, perm] @ w`` where ``perm`` is
  the act-order row permutation (None when rows are already in group order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PACK = 8
# nibble position of column j inside its 32-bit word (AutoAWQ order)
NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)
# column held by nibble p (inverse of NIBBLE_OF): AutoAWQ's pack order_map
COLUMN_OF = (0, 2, 4, 6, 1, 3, 5, 7)

__all__ = [
    "PackedW4",
    "repack_awq",
    "repack_gptq",
    "w4a16_matmul",
    "dequantize_packed",
    "unpack_cols",
    "pack_cols",
    "unpack_rows",
]


@dataclass
class PackedW4:
    """A 4-bit weight in the kernels' layout (see module docstring)."""

    qweight: torch.Tensor  # int32 [K, N // 8]
    qzeros: torch.Tensor  # int32 [n_groups, N // 8]
    scales: torch.Tensor  # fp16 [n_groups, N]
    group_size: int  # rows per group after any act-order sort (K when per-channel)
    in_features: int
    out_features: int
    perm: torch.Tensor | None = None  # int64 [K]: x columns to gather (act-order), or None
    _scales_by_dtype: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]

    def scales_as(self, dtype: torch.dtype) -> torch.Tensor:
        """Scales in the activation dtype, converted once and cached (bf16 activations)."""
        if dtype == self.scales.dtype:
            return self.scales
        cached = self._scales_by_dtype.get(dtype)
        if cached is None or cached.device != self.scales.device:
            cached = self.scales.to(dtype).contiguous()
            self._scales_by_dtype[dtype] = cached
        return cached

    def to(self, device) -> PackedW4:
        perm = None if self.perm is None else self.perm.to(device)
        return PackedW4(
            self.qweight.to(device),
            self.qzeros.to(device),
            self.scales.to(device),
            self.group_size,
            self.in_features,
            self.out_features,
            perm,
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
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> PackedW4:
    """AWQ (GEMM format) checkpoint tensors -> PackedW4.

    qweight int32 [K, N/8] and qzeros int32 [K/G, N/8] packed along N in AutoAWQ's nibble order,
    scales fp16 [K/G, N]; w = (q - z) * s.  The kernel layout *is* the AWQ layout, so this only
    validates and makes the tensors contiguous (no copy of the weight when it already is)."""
    K, n8 = qweight.shape
    N = n8 * PACK
    G = K if group_size in (-1, 0, None) else int(group_size)
    ng = math.ceil(K / G)
    _check_2d("awq qweight", qweight, (K, n8), torch.int32)
    _check_2d("awq qzeros", qzeros, (ng, n8), torch.int32)
    _check_2d("awq scales", scales, (ng, N))
    return PackedW4(
        qweight.contiguous(),
        qzeros.contiguous(),
        scales.to(torch.float16).contiguous(),
        G,
        K,
        N,
        None,
    )


def repack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    sym: bool = True,
    checkpoint_format: str = "gptq",
) -> PackedW4:
    """GPTQ checkpoint tensors -> PackedW4.

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
    scales_e = scales[chunk_group].to(torch.float16).contiguous()
    zeros_e = z[chunk_group]
    return PackedW4(
        pack_cols(q),
        pack_cols(zeros_e),
        scales_e,
        geff,
        K,
        N,
        perm,
    )


# ---------------------------------------------------------------------------------------------
# the CPU twin: dequantize the packed layout, and the reference matmul


def dequantize_packed(packed: PackedW4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[K, N] weight in the packed (sorted) row order, computed from the packed layout."""
    q = unpack_cols(packed.qweight).to(torch.float32)
    z = unpack_cols(packed.qzeros).to(torch.float32)
    s = packed.scales.to(torch.float32)
    rows = torch.arange(packed.in_features, device=q.device) // packed.group_size
    return ((q - z[rows]) * s[rows]).to(dtype)


def _reference_matmul(x2: torch.Tensor, packed: PackedW4) -> torch.Tensor:
    w = dequantize_packed(packed, torch.float32)
    return x2.to(torch.float32) @ w


def w4a16_matmul(
    x: torch.Tensor, packed: PackedW4, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """out[..., N] = x[..., K] @ W (+ bias), in x's dtype (fp16 or bf16)."""
    K, N = packed.in_features, packed.out_features
    if x.shape[-1] != K:
        raise ValueError(f"w4a16_matmul: x has {x.shape[-1]} input features, weight has {K}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)
    if x.is_cuda:
        from quantfw.kernels.triton.w4a16_kernels import w4a16_matmul_cuda

        out = w4a16_matmul_cuda(x2.contiguous(), packed, bias)
    else:
        out = _reference_matmul(x2, packed)
        if bias is not None:
            out = out + bias.to(torch.float32)
        out = out.to(x.dtype)
    return out.reshape(*lead, N)
