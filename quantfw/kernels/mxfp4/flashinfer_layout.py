"""The layout rules of FlashInfer's Blackwell grouped GEMM ``group_gemm_mxfp4_nt_groupwise``
(MXFP8 activations x MXFP4 weights) as pure tensor functions, so they are checked on the CPU
(there is no SM100 GPU here; `flashinfer.py` makes the call).

* Weights ``b [E, N, K/2]`` (our checkpoint bytes: same nibble order, low nibble first) padded
  to N % 8 == 0 and K % 128 == 0 with zeros; scales ``[E, N_pad, K_pad/32]``.
* Scale swizzle "128x4": a scale matrix [M, KG] is padded to M % 128 == 0 and KG % 4 == 0 and
  stored tile by tile (128 rows x 4 columns, row tiles outer, column tiles inner); inside a tile
  the byte of (row m, column k) sits at ``(m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4``.
* Activation rows: each expert's rows padded to a multiple of 4 (`pad_group_rows`); activation
  scales swizzled per expert, each expert's block starting at ``m_indptr_padded[e]``, a
  multiple of 128 (`m_indptr_padded`, `swizzle_grouped_scales`).

Everything is built with tensor ops from device tensors and host-known sizes (no host sync).
"""

from __future__ import annotations

import torch

ALIGN_N = 8
ALIGN_K = 128
ALIGN_M = 4
ALIGN_M_SF = 128
TILE_ROWS, TILE_COLS = 128, 4


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_weights(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [E, N, K/32, 16] + scales [E, N, K/32] -> (b [E, N_pad, K_pad/2], scales
    [E, N_pad, K_pad/32]), zero padded (a zero byte is code 0 under scale 2**-127: value 0)."""
    e, n, groups, _ = blocks.shape
    n_pad, k_pad = round_up(n, ALIGN_N), round_up(groups * 32, ALIGN_K)
    b = blocks.new_zeros(e, n_pad, k_pad // 2)
    b[:, :n, : groups * 16] = blocks.reshape(e, n, groups * 16)
    s = scales.new_zeros(e, n_pad, k_pad // 32)
    s[:, :n, :groups] = scales
    return b, s


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[B, M, KG] uint8 -> [B, M_pad, KG_pad] holding the 128x4-swizzled bytes (M_pad, KG_pad
    rounded up to 128 and 4; padding zero). Read it as flat memory, not as a matrix."""
    b, m, kg = scales.shape
    m_pad, kg_pad = round_up(m, TILE_ROWS), round_up(kg, TILE_COLS)
    padded = scales.new_zeros(b, m_pad, kg_pad)
    padded[:, :m, :kg] = scales
    # m = tile * 128 + i4 * 32 + i32, k = ktile * 4 + k4 -> [tile][ktile][i32][i4][k4]
    tiles = padded.view(b, m_pad // 128, 4, 32, kg_pad // 4, 4)
    return tiles.permute(0, 1, 4, 3, 2, 5).contiguous().view(b, m_pad, kg_pad)


def unswizzle_scales(swizzled: torch.Tensor, m: int, kg: int) -> torch.Tensor:
    """The inverse of `swizzle_scales`: [B, M_pad, KG_pad] -> [B, m, kg]."""
    b, m_pad, kg_pad = swizzled.shape
    tiles = swizzled.view(b, m_pad // 128, kg_pad // 4, 32, 4, 4)
    return tiles.permute(0, 1, 4, 3, 2, 5).reshape(b, m_pad, kg_pad)[:, :m, :kg]


def swizzled_offset(m: torch.Tensor, k: torch.Tensor, kg_pad: int) -> torch.Tensor:
    """Byte offset of scale (row m, column k) in a 128x4-swizzled matrix with kg_pad columns."""
    tile, ktile = m // 128, k // 4
    inner = (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    return (tile * (kg_pad // 4) + ktile) * 512 + inner


def m_indptr_padded(m_indptr: torch.Tensor, align: int = ALIGN_M_SF) -> torch.Tensor:
    """Where each group's activation scales start: ``(m_indptr[g] + g * (align - 1)) // align
    * align`` (every group on a multiple of 128 with room for its rows)."""
    g = torch.arange(m_indptr.numel(), device=m_indptr.device, dtype=m_indptr.dtype)
    return (m_indptr + g * (align - 1)) // align * align


def padded_rows_bound(num_rows: int, num_groups: int, align: int) -> int:
    """A static bound on the rows after padding each of `num_groups` groups to `align`."""
    return num_rows + num_groups * (align - 1)


def pad_group_rows(
    m_indptr: torch.Tensor, expert_of_row: torch.Tensor, align: int = ALIGN_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded m_indptr with every group a multiple of `align` rows, the padded position of
    each real row). Rows keep their order; padding rows sit at the end of their group."""
    counts = m_indptr[1:] - m_indptr[:-1]
    padded = torch.zeros_like(m_indptr)
    torch.cumsum((counts + align - 1) // align * align, 0, out=padded[1:])
    rows = torch.arange(expert_of_row.numel(), device=m_indptr.device)
    return padded, rows - m_indptr[expert_of_row] + padded[expert_of_row]


def swizzle_grouped_scales(
    scales: torch.Tensor, m_indptr: torch.Tensor, group_of_row: torch.Tensor
) -> torch.Tensor:
    """Activation scales [M, KG] of rows grouped by `m_indptr` -> [M_sf, KG_pad] bytes: group g's
    rows swizzled (128x4) as a matrix of their own starting at row ``m_indptr_padded[g]``;
    M_sf = ``m_indptr_padded[-1]``'s static bound (M + G * 127, rounded down to 128). Rows whose
    group is G (past the last group) are dropped."""
    rows, kg = scales.shape
    groups = m_indptr.numel() - 1
    kg_pad = round_up(kg, TILE_COLS)
    total = (rows + groups * (ALIGN_M_SF - 1)) // ALIGN_M_SF * ALIGN_M_SF
    out = scales.new_zeros(total * kg_pad + kg)  # + one row where dropped rows land
    if rows:
        starts = m_indptr_padded(m_indptr)
        owner = group_of_row.clamp(max=groups - 1)
        local = torch.arange(rows, device=scales.device) - m_indptr[owner]
        k = torch.arange(kg, device=scales.device).unsqueeze(0)
        offsets = starts[owner].unsqueeze(1) * kg_pad + swizzled_offset(
            local.unsqueeze(1), k, kg_pad
        )
        offsets = torch.where((group_of_row < groups).unsqueeze(1), offsets, total * kg_pad + k)
        out[offsets.reshape(-1)] = scales.reshape(-1)
    return out[: total * kg_pad].view(total, kg_pad)
