"""Tokens sorted by expert (the rows every grouped GEMM reads) and the weighted combine back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertSort:
    """The T*k (token, expert) assignments as rows sorted by expert (stable: token order within
    an expert). Row ``r`` reads token ``token_index[r]``; expert ``e`` owns rows
    ``m_indptr[e]:m_indptr[e + 1]``; assignment ``(t, j)`` (flat ``t * k + j``) is row
    ``inverse[t * k + j]``."""

    token_index: torch.Tensor  # [T*k] int64
    expert_of_row: torch.Tensor  # [T*k] int64
    inverse: torch.Tensor  # [T*k] int64
    m_indptr: torch.Tensor  # [E + 1] int64
    top_k: int


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertSort:
    """Sort the assignments of `topk_ids` [T, k] by expert, without a host sync."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts)
    m_indptr = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(counts, 0, out=m_indptr[1:])
    return ExpertSort(
        token_index=order // topk_ids.shape[-1],
        expert_of_row=flat[order],
        inverse=inverse,
        m_indptr=m_indptr,
        top_k=topk_ids.shape[-1],
    )


def combine(rows: torch.Tensor, sort: ExpertSort, topk_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * rows[row of (t, j)], for the experts' outputs `rows` [T*k, H]
    in sorted order (a fixed summation order: deterministic)."""
    t, k = topk_weights.shape
    picked = rows[sort.inverse].view(t, k, rows.shape[-1])
    return (picked * topk_weights.unsqueeze(-1).to(rows.dtype)).sum(dim=1)
