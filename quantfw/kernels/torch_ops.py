"""Repacking into torch's fused int4 layouts and the matching matmuls.

Both ops compute ``y = x @ W.T`` with ``W[n, k] = (q[n, k] - 8) * scale + zero`` per group of
``qGroupSize`` consecutive k, where ``scales_and_zeros[k // qGroupSize, n] = (scale, zero)``:

- CPU: ``aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], inner_k_tiles)`` and
  ``aten._weight_int4pack_mm_for_cpu(x, w, qGroupSize, scales_and_zeros)``; x may be fp32,
  fp16 or bf16 (scales_and_zeros in the same dtype). Verified on torch 2.13: N % 16 == 0,
  qGroupSize in {32, 64, 128, 256}, K % qGroupSize == 0.
- CUDA (tinygemm): ``aten._convert_weight_to_int4pack(q uint8 [N, K / 2], inner_k_tiles)``
  (even k in the high nibble) and ``aten._weight_int4pack_mm``; bf16 only, N % 8 == 0,
  K % (inner_k_tiles * 16) == 0.

An affine code with integer zero point z becomes ``(q - z) * s == (q - 8) * s + (8 - z) * s``,
so ``zero = (2**(bits-1) - z) * s`` (GPTQModel's torch_fused AWQ shim, reference 002).

Arbitrary group maps (act-order ``g_idx``, partial or split groups on a TP shard) are handled by
a row plan: input rows are sorted by group and each group is padded to a multiple of the kernel
group size with rows that multiply an appended zero activation, so results never change.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

KERNEL_GROUP_SIZES = (256, 128, 64, 32)
_PAD_CODE = 8  # a padded weight row/column: (8 - 8) * s + 0 == 0


class Int4Pack(NamedTuple):
    """Tensors for one fused int4 linear (register them as buffers)."""

    weight: torch.Tensor  # op-specific packed weight, N padded
    scales_and_zeros: torch.Tensor  # [K' / group_size, N', 2]
    gather: torch.Tensor | None  # [K'] rows of x (index K = a zero column); None: identity
    group_size: int  # kernel group size


def fused_int4_available(device: torch.device) -> bool:
    """Whether torch has the fused int4 ops for `device` (CPU, or CUDA sm80+)."""
    if device.type == "cpu":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return False


def _row_plan(g_idx: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gather [K'], group of each kernel chunk, kernel group size) for input rows grouped by
    `g_idx`: rows sorted by group, each group padded to a multiple of the kernel group size."""
    k = g_idx.numel()
    g = g_idx.long()
    counts = torch.bincount(g, minlength=num_groups)
    present = counts[counts > 0]
    kg = next((s for s in KERNEL_GROUP_SIZES if bool((present % s == 0).all())), 32)
    padded = (counts + kg - 1) // kg * kg
    order = torch.argsort(g, stable=True)
    g_sorted = g[order]
    start_in = torch.cumsum(counts, 0) - counts
    start_out = torch.cumsum(padded, 0) - padded
    dest = start_out[g_sorted] + torch.arange(k, device=g.device) - start_in[g_sorted]
    gather = torch.full((int(padded.sum()),), k, dtype=torch.long, device=g.device)
    gather[dest] = order
    chunk_group = torch.repeat_interleave(torch.arange(num_groups, device=g.device), padded // kg)
    return gather, chunk_group, kg


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def build_int4pack(
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    dtype: torch.dtype,
) -> Int4Pack:
    """Repack 4-bit `codes [K, N]` with integer `zeros [G, N]`, `scales [G, N]` and the group of
    each input row `g_idx [K]` for the fused op of `codes.device`."""
    device = codes.device
    k, n = codes.shape
    gather, chunk_group, kg = _row_plan(g_idx, scales.shape[0])
    n_pad = _round_up(n, 16 if device.type == "cpu" else 8)
    identity = gather.numel() == k and bool((gather == torch.arange(k, device=device)).all())
    rows = codes if identity else F.pad(codes, (0, 0, 0, 1), value=_PAD_CODE)[gather]
    w = F.pad(rows.t().to(torch.int32), (0, 0, 0, n_pad - n), value=_PAD_CODE).contiguous()
    s = scales.float()
    offsets = (8.0 - zeros.float()) * s
    sz = torch.stack([s[chunk_group], offsets[chunk_group]], dim=-1)
    sz = F.pad(sz, (0, 0, 0, n_pad - n)).contiguous()
    if device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
        sz = sz.to(dtype)
    else:
        k_pad = w.shape[1]
        inner = next(t for t in (8, 4, 2) if k_pad % (t * 16) == 0)
        w_u8 = ((w[:, ::2] << 4) | w[:, 1::2]).to(torch.uint8).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(w_u8, inner)
        sz = sz.to(torch.bfloat16)
    return Int4Pack(packed, sz, None if identity else gather, kg)


def int4pack_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    gather: torch.Tensor | None,
    group_size: int,
    out_features: int,
) -> torch.Tensor:
    """``x [..., K] @ W.T`` with W in the layout of `build_int4pack`; returns [..., out_features]."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if gather is not None:
        x2 = F.pad(x2, (0, 1))[:, gather]
    x2 = x2.contiguous()
    if x.device.type == "cpu":
        sz = scales_and_zeros if scales_and_zeros.dtype == x.dtype else scales_and_zeros.to(x.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight, group_size, sz)
    else:
        y = torch.ops.aten._weight_int4pack_mm(
            x2.to(torch.bfloat16), weight, group_size, scales_and_zeros
        ).to(x.dtype)
    return y[:, :out_features].reshape(*lead, out_features)
