"""The small steps around the grouped GEMMs as single kernels (each torch op is a launch, and a
decode step of a MoE layer would otherwise launch dozens):

* `align`: one program sorts the (token, expert) assignments by expert and cuts the row blocks
  (`kernels.moe.ExpertSort` + `BlockPlan`), with histograms and prefix sums over an
  [assignments x experts] tile, so it serves decode-sized batches (assignments * experts <=
  `ALIGN_MAX_TILE`); `sort_and_plan` does the same for any batch in chunks of that tile, in three
  launches;
* `combine`: the weighted sum of each token's k expert rows, one program per token (every
  batch size).

The counts that change with every step's size (assignments, blocks, chunks) are not
specialized: Triton would compile a variant the first time each is 1 or a multiple of 16, in
the middle of serving.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.common import pdl
from quantfw.kernels.moe.sort import BlockPlan, ExpertSort, fewest_blocks, max_blocks

ALIGN_MAX_TILE = 16384


@triton.jit(do_not_specialize=["num_rows", "num_blocks"])
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
    ex = tl.arange(0, EXPERTS_P)
    onehot, e_i = _onehot(ids_ptr, i, num_rows, EXPERTS_P)
    counts = tl.sum(onehot, axis=0)
    starts = tl.cumsum(counts, axis=0) - counts  # exclusive; starts[E] = num_rows
    rank = tl.sum(tl.where(onehot > 0, tl.cumsum(onehot, axis=0) - 1, 0), axis=1)
    pos = tl.sum(tl.where(onehot > 0, starts[None, :], 0), axis=1) + rank
    tl.store(token_index_ptr + pos, (i // TOP_K).to(tl.int64), mask=valid)
    tl.store(expert_of_row_ptr + pos, e_i.to(tl.int64), mask=valid)
    tl.store(inverse_ptr + i, pos.to(tl.int64), mask=valid)
    _store_plan(
        counts, starts, ex, m_indptr_ptr, block_expert_ptr, block_row_ptr, num_experts,
        num_blocks, BLOCK_M, BLOCKS_P,
    )  # fmt: skip


@triton.jit
def _store_plan(
    counts, starts, ex, m_indptr_ptr, block_expert_ptr, block_row_ptr, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, BLOCKS_P: tl.constexpr,
):  # fmt: skip
    """m_indptr and the block plan from the rows per expert (`counts`, their exclusive prefix
    sums `starts`, over experts `ex`)."""
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


@triton.jit
def _onehot(ids_ptr, i, num_rows, EXPERTS_P: tl.constexpr):
    """The experts of assignments i as a one-hot [len(i), EXPERTS_P] int32 (zero rows past
    num_rows), and the experts."""
    valid = i < num_rows
    e_i = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    ex = tl.arange(0, EXPERTS_P)
    return ((e_i[:, None] == ex[None, :]) & valid[:, None]).to(tl.int32), e_i


@triton.jit(do_not_specialize=["num_rows"])
def _chunk_counts_kernel(
    ids_ptr, counts_ptr, num_rows, CHUNK: tl.constexpr, EXPERTS_P: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """counts[c, e]: the assignments of chunk c (CHUNK of them) routed to expert e."""
    pdl.wait_and_release(PDL)
    c = tl.program_id(0)
    onehot, _ = _onehot(ids_ptr, c * CHUNK + tl.arange(0, CHUNK), num_rows, EXPERTS_P)
    tl.store(counts_ptr + c * EXPERTS_P + tl.arange(0, EXPERTS_P), tl.sum(onehot, axis=0))


@triton.jit(do_not_specialize=["n_chunks"])
def _chunk_prefix_kernel(
    counts_ptr, n_chunks, EXPERTS_P: tl.constexpr, CHUNKS_STEP: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """In place, one program: counts[c, e] -> the assignments to expert e in chunks before c
    (an exclusive prefix over chunks), and row n_chunks <- each expert's total."""
    pdl.wait_and_release(PDL)
    ex = tl.arange(0, EXPERTS_P)
    carry = tl.zeros([EXPERTS_P], dtype=tl.int32)
    for c0 in range(0, n_chunks, CHUNKS_STEP):
        cc = c0 + tl.arange(0, CHUNKS_STEP)
        ptrs = counts_ptr + cc[:, None] * EXPERTS_P + ex[None, :]
        inside = (cc < n_chunks)[:, None]
        cnt = tl.load(ptrs, mask=inside, other=0)
        tl.store(ptrs, carry[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=inside)
        carry += tl.sum(cnt, axis=0)
    tl.store(counts_ptr + n_chunks * EXPERTS_P + ex, carry)


@triton.jit(do_not_specialize=["num_rows", "num_blocks", "n_chunks"])
def _sort_chunks_kernel(
    ids_ptr, counts_ptr, token_index_ptr, expert_of_row_ptr, inverse_ptr, m_indptr_ptr,
    block_expert_ptr, block_row_ptr, num_rows, num_experts, num_blocks, n_chunks,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, EXPERTS_P: tl.constexpr,
    BLOCKS_P: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Chunk c's assignments to their sorted rows: expert e's rows start after all rows of
    experts < e, then chunk c's come after those of chunks < c (stable; `counts` holds the
    prefixes over chunks and the totals); program 0 also writes m_indptr and the block plan."""
    pdl.wait_and_release(PDL)
    c = tl.program_id(0)
    ex = tl.arange(0, EXPERTS_P)
    before = tl.load(counts_ptr + c * EXPERTS_P + ex)
    total = tl.load(counts_ptr + n_chunks * EXPERTS_P + ex)
    starts = tl.cumsum(total, axis=0) - total  # exclusive; starts[E] = num_rows
    i = c * CHUNK + tl.arange(0, CHUNK)
    onehot, e_i = _onehot(ids_ptr, i, num_rows, EXPERTS_P)
    rank = tl.sum(tl.where(onehot > 0, tl.cumsum(onehot, axis=0) - 1, 0), axis=1)
    pos = tl.sum(tl.where(onehot > 0, (starts + before)[None, :], 0), axis=1) + rank
    valid = i < num_rows
    tl.store(token_index_ptr + pos, (i // TOP_K).to(tl.int64), mask=valid)
    tl.store(expert_of_row_ptr + pos, e_i.to(tl.int64), mask=valid)
    tl.store(inverse_ptr + i, pos.to(tl.int64), mask=valid)
    if c == 0:
        _store_plan(
            total, starts, ex, m_indptr_ptr, block_expert_ptr, block_row_ptr, num_experts,
            num_blocks, BLOCK_M, BLOCKS_P,
        )  # fmt: skip


def align_fits(num_rows: int, num_experts: int) -> bool:
    return (
        triton.next_power_of_2(max(num_rows, 1)) * triton.next_power_of_2(num_experts + 1)
        <= ALIGN_MAX_TILE
    )


def _outputs(rows: int, num_experts: int, num_blocks: int, device: torch.device):
    """token_index, expert_of_row, inverse, m_indptr, block_expert, block_row, uninitialised."""
    token_index = torch.empty(rows, dtype=torch.int64, device=device)
    m_indptr = torch.empty(num_experts + 1, dtype=torch.int64, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    return (
        token_index, torch.empty_like(token_index), torch.empty_like(token_index), m_indptr,
        block_expert, torch.empty_like(block_expert),
    )  # fmt: skip


def _sort_and_plan_of(outs, rows: int, top_k: int, block_m: int) -> tuple[ExpertSort, BlockPlan]:
    """`_outputs`, written by a sort kernel, as the sort and its block plan."""
    token_index, expert_of_row, inverse, m_indptr, block_expert, block_row = outs
    sort = ExpertSort(token_index, expert_of_row, inverse, m_indptr, top_k)
    least = fewest_blocks(rows, block_m, top_k, block_expert.numel())
    return sort, BlockPlan(block_expert, block_row, m_indptr, rows, block_m, least)


def sort_and_plan(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[ExpertSort, BlockPlan]:
    """`kernels.moe.sort_by_expert` and `block_schedule` (the same stable order) for any batch,
    in three launches: per-chunk expert counts, their prefix over chunks (one program), then
    each chunk's rows placed (a prefill's torch sort and plan were about 35 launches, most of
    a MoE layer's host time)."""
    rows, top_k = topk_ids.numel(), topk_ids.shape[-1]
    dev = topk_ids.device
    num_blocks = max_blocks(rows, num_experts, block_m)
    experts_p = triton.next_power_of_2(num_experts + 1)
    chunk = max(16, ALIGN_MAX_TILE // experts_p)
    n_chunks = max(1, triton.cdiv(rows, chunk))
    outs = _outputs(rows, num_experts, num_blocks, dev)
    counts = torch.empty(n_chunks + 1, experts_p, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    launch = pdl.launch_options(pdl.enabled(dev))
    _chunk_counts_kernel[(n_chunks,)](
        ids, counts, rows, CHUNK=chunk, EXPERTS_P=experts_p, num_warps=4, **launch
    )
    _chunk_prefix_kernel[(1,)](
        counts, n_chunks, EXPERTS_P=experts_p, CHUNKS_STEP=chunk, num_warps=4, **launch
    )
    _sort_chunks_kernel[(n_chunks,)](
        ids, counts, *outs, rows, num_experts, num_blocks, n_chunks, TOP_K=top_k,
        BLOCK_M=block_m, CHUNK=chunk, EXPERTS_P=experts_p,
        BLOCKS_P=triton.next_power_of_2(max(num_blocks, 1)), num_warps=4, **launch,
    )  # fmt: skip
    return _sort_and_plan_of(outs, rows, top_k, block_m)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[ExpertSort, BlockPlan]:
    """`kernels.moe.sort_by_expert` and `block_schedule` in one launch (see `align_fits`)."""
    rows, top_k = topk_ids.numel(), topk_ids.shape[-1]
    dev = topk_ids.device
    num_blocks = max_blocks(rows, num_experts, block_m)
    rows_p, experts_p = (
        triton.next_power_of_2(max(rows, 1)),
        triton.next_power_of_2(num_experts + 1),
    )
    outs = _outputs(rows, num_experts, num_blocks, dev)
    _align_kernel[(1,)](
        topk_ids.reshape(-1),
        *outs,
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
    return _sort_and_plan_of(outs, rows, top_k, block_m)


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
