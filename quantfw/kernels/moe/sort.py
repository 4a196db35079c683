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
    # scatter_add, not bincount: bincount sizes its output on the host (a sync; no CUDA graph)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    m_indptr = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(counts, 0, out=m_indptr[1:])
    return ExpertSort(
        token_index=order // topk_ids.shape[-1],
        expert_of_row=flat[order],
        inverse=inverse,
        m_indptr=m_indptr,
        top_k=topk_ids.shape[-1],
    )


@dataclass
class BlockPlan:
    """Row blocks of a grouped GEMM: block ``b`` covers sorted rows ``block_row[b] ..
    min(block_row[b] + block_m, m_indptr[e + 1])`` of expert ``e = block_expert[b]``; blocks
    past the last real one carry ``e = num_experts`` (their programs exit). The block count is
    a static bound, so building and running a plan never synchronises with the host;
    ``min_blocks`` is the fewest real blocks there can be (split-K kernels plan for it, so that
    routing to few experts still fills the GPU)."""

    block_expert: torch.Tensor  # [num_blocks] int32
    block_row: torch.Tensor  # [num_blocks] int32
    m_indptr: torch.Tensor  # [E + 1]
    num_rows: int
    block_m: int
    min_blocks: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def fewest_blocks(num_rows: int, block_m: int, top_k: int, num_blocks: int) -> int:
    """The fewest real blocks of a plan: every block holds at most `block_m` rows, and each
    token's `top_k` experts are distinct, so at least `top_k` experts own a block."""
    if num_rows == 0:
        return 0
    return min(num_blocks, max(-(-num_rows // block_m), top_k))


def max_blocks(num_rows: int, num_experts: int, block_m: int) -> int:
    """A bound on a plan's blocks: expert e needs ceil(n_e / block_m) <= n_e // block_m + 1,
    and at most min(rows, E) experts hold rows."""
    return min(num_rows, num_experts) + num_rows // block_m


def block_schedule(
    m_indptr: torch.Tensor, num_rows: int, block_m: int, top_k: int = 1
) -> BlockPlan:
    """Cut each expert's rows into blocks of `block_m` (`max_blocks` of them, those past the
    real ones owned by expert E); `top_k`: the distinct experts of each token (for
    ``min_blocks``)."""
    num_experts = m_indptr.numel() - 1
    device = m_indptr.device
    num_blocks = max_blocks(num_rows, num_experts, block_m)
    counts = m_indptr[1:] - m_indptr[:-1]
    block_indptr = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    torch.cumsum((counts + block_m - 1) // block_m, 0, out=block_indptr[1:])
    b = torch.arange(num_blocks, device=device)
    expert = torch.searchsorted(block_indptr[1:], b, right=True)
    owner = expert.clamp(max=num_experts - 1)
    row = m_indptr[owner] + (b - block_indptr[owner]) * block_m
    least = fewest_blocks(num_rows, block_m, top_k, num_blocks)
    return BlockPlan(
        expert.to(torch.int32), row.to(torch.int32), m_indptr, num_rows, block_m, least
    )


def single_group(num_rows: int, block_m: int, device: torch.device) -> BlockPlan:
    """The plan of one group holding all `num_rows` rows (a dense layer), built on `device`."""
    num_blocks = -(-num_rows // block_m)
    b = torch.arange(num_blocks, device=device, dtype=torch.int32)
    m_indptr = torch.arange(2, device=device, dtype=torch.int64) * num_rows
    return BlockPlan(torch.zeros_like(b), b * block_m, m_indptr, num_rows, block_m, num_blocks)


def combine(rows: torch.Tensor, sort: ExpertSort, topk_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * rows[row of (t, j)], for the experts' outputs `rows` [T*k, H]
    in sorted order (a fixed summation order: deterministic)."""
    t, k = topk_weights.shape
    picked = rows[sort.inverse].view(t, k, rows.shape[-1])
    return (picked * topk_weights.unsqueeze(-1).to(rows.dtype)).sum(dim=1)
