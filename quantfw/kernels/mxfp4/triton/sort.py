"""The small steps around the grouped GEMMs, as single kernels for decode-sized batches (each
torch op is a launch, and a decode step of a MoE layer would otherwise launch dozens):

* `align`: one program sorts the (token, expert) assignments by expert and cuts the row blocks
  (`kernels.moe.ExpertSort` + `BlockPlan`), with histograms and prefix sums over an
  [assignments x experts] tile, so it serves assignments * experts <= `ALIGN_MAX_TILE`;
* `combine`: the weighted sum of each token's k expert rows, one program per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.common import pdl
from quantfw.kernels.moe.sort import BlockPlan, ExpertSort, fewest_blocks

ALIGN_MAX_TILE = 16384


@triton.jit
def _align_kernel(
    ids_ptr,
    token_index_ptr,
    expert_of_row_ptr,
    inverse_ptr,
    m_indptr_ptr,
    block_expert_ptr,
    block_row_ptr,
    num_rows,
    num_experts,
    num_blocks,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS_P: tl.constexpr,
    EXPERTS_P: tl.constexpr,
    BLOCKS_P: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.wait_and_release(PDL)
    i = tl.arange(0, ROWS_P)
    valid = i < num_rows
    e_i = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    ex = tl.arange(0, EXPERTS_P)
    onehot = ((e_i[:, None] == ex[None, :]) & valid[:, None]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)
    starts = tl.cumsum(counts, axis=0) - counts  # exclusive; starts[E] = num_rows
    rank = tl.sum(tl.where(onehot > 0, tl.cumsum(onehot, axis=0) - 1, 0), axis=1)
    pos = tl.sum(tl.where(onehot > 0, starts[None, :], 0), axis=1) + rank
    tl.store(token_index_ptr + pos, (i // TOP_K).to(tl.int64), mask=valid)
    tl.store(expert_of_row_ptr + pos, e_i.to(tl.int64), mask=valid)
    tl.store(inverse_ptr + i, pos.to(tl.int64), mask=valid)
    tl.store(m_indptr_ptr + ex, starts.to(tl.int64), mask=ex <= num_experts)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first = tl.cumsum(blocks, axis=0) - blocks
    b = tl.arange(0, BLOCKS_P)
    ended = ((first + blocks)[None, :] <= b[:, None]) & (ex[None, :] < num_experts)
    owner = tl.sum(ended.to(tl.int32), axis=1)  # num_experts past the last real block
    mine = ex[None, :] == owner[:, None]
    row = tl.sum(
        tl.where(mine, starts[None, :] + (b[:, None] - first[None, :]) * BLOCK_M, 0), axis=1
    )
    tl.store(block_expert_ptr + b, owner, mask=b < num_blocks)
    tl.store(block_row_ptr + b, row, mask=b < num_blocks)


def align_fits(num_rows: int, num_experts: int) -> bool:
    return (
        triton.next_power_of_2(max(num_rows, 1)) * triton.next_power_of_2(num_experts + 1)
        <= ALIGN_MAX_TILE
    )


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[ExpertSort, BlockPlan]:
    """`kernels.moe.sort_by_expert` and `block_schedule` in one launch (see `align_fits`)."""
    rows, top_k = topk_ids.numel(), topk_ids.shape[-1]
    dev = topk_ids.device
    num_blocks = min(rows, num_experts) + rows // block_m
    rows_p, experts_p = (
        triton.next_power_of_2(max(rows, 1)),
        triton.next_power_of_2(num_experts + 1),
    )
    token_index = torch.empty(rows, dtype=torch.int64, device=dev)
    expert_of_row = torch.empty_like(token_index)
    inverse = torch.empty_like(token_index)
    m_indptr = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    block_row = torch.empty_like(block_expert)
    _align_kernel[(1,)](
        topk_ids.reshape(-1),
        token_index,
        expert_of_row,
        inverse,
        m_indptr,
        block_expert,
        block_row,
        rows,
        num_experts,
        num_blocks,
        TOP_K=top_k,
        BLOCK_M=block_m,
        ROWS_P=rows_p,
        EXPERTS_P=experts_p,
        BLOCKS_P=triton.next_power_of_2(max(num_blocks, 1)),
        num_warps=8 if rows_p * experts_p >= 8192 else 4,
        **pdl.launch_options(pdl.enabled(topk_ids.device)),
    )
    sort = ExpertSort(token_index, expert_of_row, inverse, m_indptr, top_k)
    least = fewest_blocks(rows, block_m, top_k, num_blocks)
    return sort, BlockPlan(block_expert, block_row, m_indptr, rows, block_m, least)


@triton.jit
def _combine_kernel(
    rows_ptr,
    inverse_ptr,
    weights_ptr,
    out_ptr,
    H,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.wait_and_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(inverse_ptr + t * TOP_K + j)
        w = tl.load(weights_ptr + t * TOP_K + j).to(tl.float32)
        acc += w * tl.load(rows_ptr + row * H + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(rows: torch.Tensor, sort: ExpertSort, topk_weights: torch.Tensor) -> torch.Tensor:
    """`kernels.moe.combine` in one launch (float32 sum, in order j = 0..k-1)."""
    t, k = topk_weights.shape
    h = rows.shape[-1]
    out = torch.empty(t, h, dtype=rows.dtype, device=rows.device)
    if t:
        block = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, block))](
            rows,
            sort.inverse,
            topk_weights.contiguous(),
            out,
            h,
            TOP_K=k,
            BLOCK_H=block,
            **pdl.launch_options(pdl.enabled(rows.device)),
        )
    return out
