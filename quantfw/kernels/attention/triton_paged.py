"""Triton kernels for attention over a paged KV cache.

Cache layout per layer: ``k_cache``/``v_cache`` ``[num_blocks, block_size, kv_heads, head_dim]``
(contiguous); a token at flat row ``slot = block * block_size + offset`` occupies
``[slot * kv_heads * head_dim, (slot + 1) * kv_heads * head_dim)``. A sequence's block table row
maps its logical block ``i`` (tokens ``[i * block_size, (i + 1) * block_size)``) to a block id.

* `store_kv`: new keys/values -> their slots (one program per token).
* `paged_decode`: one query token per sequence. Flash-decoding: the sequence's context is split
  into `num_splits` equal spans (block-aligned), a program per (sequence, kv head, span) attends
  all query heads of that kv head's group, and a second kernel merges the spans by their
  log-sum-exp. With one span the first kernel writes the output itself. With programmatic
  dependent launch it reads its first tile's keys and values of earlier steps before it waits
  for the kernel that stored the new token's (`common.pdl`).
* `paged_prefill`: any number of query tokens per sequence (prefill, chunked prefill, mixed
  batches): a program per (sequence, query tile, head), causal over the cached context.

Both attention kernels take a sliding window (key j is visible to the query at position i when
``i - window < j <= i``) and attention sinks (a per-head logit that joins the softmax
denominator only, as in GPT-OSS). Shapes depend only on the batch size, so `paged_decode` is
CUDA-graph capturable with the real context lengths in a tensor. The block tables' row stride
(an eager step's widest table) is not specialized: Triton would compile a variant the first
time a step's width is a multiple of 16, in the middle of serving.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.common import pdl

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slots, k_stride, v_stride, KVD: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_and_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    for start in range(0, KVD, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < KVD
        k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
        v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
        tl.store(k_cache + slot * KVD + offs, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + slot * KVD + offs, v.to(v_cache.dtype.element_ty), mask=mask)


def _check_heads(x: torch.Tensor, name: str) -> None:
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(
            f"{name} must be [tokens, heads, head_dim] with packed heads, got shape "
            f"{tuple(x.shape)} strides {x.stride()}"
        )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write k/v [T, kv_heads, head_dim] (row-strided views are fine) at flat rows `slots` [T]."""
    _check_heads(k, "k")
    _check_heads(v, "v")
    tokens = k.shape[0]
    if tokens == 0:
        return
    kvd = k.shape[1] * k.shape[2]
    block = min(1024, triton.next_power_of_2(kvd))
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), KVD=kvd, BLOCK=block,
        num_warps=4,
        **pdl.launch_options(pdl.enabled(k.device)),
    )  # fmt: skip


@triton.jit
def _attend_tile(q, k, v, nmask, m, denom, acc, scale_log2, PRECISION: tl.constexpr):
    """Online softmax over one tile of keys (``nmask``: the real ones): the running max ``m``
    (log2 units), denominator and unnormalised output of the query heads, updated."""
    s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PRECISION) * scale_log2
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    denom = denom * alpha + tl.sum(p, axis=1)
    return m_new, denom, acc


@triton.jit
def _tile_rows(
    block_tables, b, bt_stride, g, n0, hi, kv_row,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Positions ``n0 + [0, BLOCK_N)``, which of them are below `hi`, and each one's element
    offset of kv head `g` in the paged cache (through the sequence's block table)."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < hi
    blk = tl.load(block_tables + b * bt_stride + n // PAGE, mask=nmask, other=0).to(tl.int64)
    return n, nmask, (blk * PAGE + n % PAGE) * kv_row + g * HEAD_DIM


@triton.jit(do_not_specialize=["bt_stride"])
def _paged_decode_kernel(
    q_ptr, k_cache, v_cache, block_tables, context_lens, sinks_ptr, out_ptr, part_out, part_lse,
    q_stride_t, q_stride_h, bt_stride, out_stride_t, scale_log2, window,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    # With PDL the previous kernel (the one that stored the new token's key and value) may
    # still run until the wait: before it, only the step's metadata and the keys and values
    # cached by earlier steps (positions below ctx - 1) of the first tile are read.
    pdl.triton_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - window, 0)
    span = tl.cdiv(tl.cdiv(ctx - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * span
    hi = tl.minimum(ctx, lo + span)

    r = tl.arange(0, GROUP_P)
    heads = g * GROUP + r
    hmask = r < GROUP
    d = tl.arange(0, D_P)
    dmask = d < HEAD_DIM
    kv_row = NUM_KV_HEADS * HEAD_DIM
    # the first tile's cached keys and values, then the wait, then q and the new token's row
    n, nmask, rows = _tile_rows(
        block_tables, b, bt_stride, g, lo, hi, kv_row, HEAD_DIM, PAGE, BLOCK_N
    )
    cached = (nmask & (n < ctx - 1))[:, None] & dmask[None, :]
    k = tl.load(k_cache + rows[:, None] + d[None, :], mask=cached, other=0.0)
    v = tl.load(v_cache + rows[:, None] + d[None, :], mask=cached, other=0.0)
    pdl.triton_wait(PDL)
    q = tl.load(
        q_ptr + b * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    new = (nmask & (n >= ctx - 1))[:, None] & dmask[None, :]
    k = tl.where(new, tl.load(k_cache + rows[:, None] + d[None, :], mask=new, other=0.0), k)
    v = tl.where(new, tl.load(v_cache + rows[:, None] + d[None, :], mask=new, other=0.0), v)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D_P], tl.float32)
    if lo < hi:
        m, denom, acc = _attend_tile(q, k, v, nmask, m, denom, acc, scale_log2, PRECISION)
    for n0 in range(lo + BLOCK_N, hi, BLOCK_N):
        n, nmask, rows = _tile_rows(
            block_tables, b, bt_stride, g, n0, hi, kv_row, HEAD_DIM, PAGE, BLOCK_N
        )
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache + rows[:, None] + d[None, :], mask=kvmask, other=0.0)
        v = tl.load(v_cache + rows[:, None] + d[None, :], mask=kvmask, other=0.0)
        m, denom, acc = _attend_tile(q, k, v, nmask, m, denom, acc, scale_log2, PRECISION)

    out_mask = hmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = (
                tl.load(sinks_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
                * 1.4426950408889634
            )
            m_all = tl.maximum(m, sink)
            scale_old = tl.exp2(m - m_all)
            denom = denom * scale_old + tl.exp2(sink - m_all)
            acc = acc * scale_old[:, None]
        out = acc / denom[:, None]
        tl.store(
            out_ptr + b * out_stride_t + heads[:, None] * HEAD_DIM + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        safe_l = tl.where(denom > 0, denom, 1.0)
        base = (b * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out + base[:, None] * D_P + d[None, :], acc / safe_l[:, None], mask=out_mask)
        lse = tl.where(denom > 0, m + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse + base, lse, mask=hmask)


@triton.jit
def _merge_splits_kernel(
    part_out, part_lse, sinks_ptr, out_ptr, out_stride_t,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr, S_P: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_and_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, S_P)
    smask = sp < NUM_SPLITS
    base = (b * NUM_HEADS + h) * NUM_SPLITS
    lse = tl.load(part_lse + base + sp, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    d = tl.arange(0, D_P)
    dmask = d < HEAD_DIM
    parts = tl.load(
        part_out + (base + sp)[:, None] * D_P + d[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], axis=0) / denom
    tl.store(
        out_ptr + b * out_stride_t + h * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=dmask
    )


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, block: int = 64) -> int:
    """Spans per sequence: enough programs to fill the GPU (~2 per SM, 132 SMs on an H100/H200),
    at most one span per `block` keys and at most 32."""
    want = -(-264 // max(num_seqs * num_kv_heads, 1))
    return max(1, min(32, want, -(-max_context_len // block)))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence: q [B, heads, head_dim] -> [B, heads * head_dim]."""
    _check_heads(q, "q")
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    d_p = max(16, triton.next_power_of_2(head_dim))
    if out is None:
        out = torch.empty(batch, num_heads * head_dim, dtype=q.dtype, device=q.device)
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            batch, num_heads, num_splits, d_p, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    sinks_arg = sinks if sinks is not None else out
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, sinks_arg, out, part_out, part_lse,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), scale * LOG2E,
        sliding_window or 0,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_P=d_p, PAGE=page,
        BLOCK_N=64, NUM_SPLITS=num_splits, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, PRECISION=_precision(q.dtype), num_warps=4, num_stages=2,
        **pdl.launch_options(pdl.enabled(q.device)),
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, sinks_arg, out, out.stride(0),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_P=d_p, NUM_SPLITS=num_splits,
            S_P=triton.next_power_of_2(num_splits), HAS_SINKS=sinks is not None, num_warps=4,
            **pdl.launch_options(pdl.enabled(q.device)),
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["bt_stride"])
def _paged_prefill_kernel(
    q_ptr, k_cache, v_cache, block_tables, query_start_loc, context_lens, sinks_ptr, out_ptr,
    q_stride_t, q_stride_h, bt_stride, out_stride_t, scale_log2, window,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_and_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(query_start_loc + b)
    q_len = tl.load(query_start_loc + b + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    ctx = tl.load(context_lens + b)
    g = h // GROUP
    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    qpos = ctx - q_len + rows
    d = tl.arange(0, D_P)
    dmask = d < HEAD_DIM
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * q_stride_t + h * q_stride_h + d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )
    hi = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - q_len + m0 - window + 1, 0)
    if HAS_SINKS:
        m = (
            tl.zeros([BLOCK_M], tl.float32)
            + tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        )
        denom = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    kv_row = NUM_KV_HEADS * HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < hi
        blk = tl.load(block_tables + b * bt_stride + n // PAGE, mask=nmask, other=0).to(tl.int64)
        kv_rows = (blk * PAGE + n % PAGE) * kv_row + g * HEAD_DIM
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache + kv_rows[:, None] + d[None, :], mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PRECISION) * scale_log2
        visible = nmask[None, :] & (n[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        v = tl.load(v_cache + kv_rows[:, None] + d[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * out_stride_t + h * HEAD_DIM + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & dmask[None, :],
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (the last ``query_len`` of its context,
    already stored in the cache) over its cached context: q [T, heads, head_dim] ->
    [T, heads * head_dim]."""
    _check_heads(q, "q")
    tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    out = torch.empty(tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    batch = context_lens.shape[0]
    d_p = max(16, triton.next_power_of_2(head_dim))
    block_m = 64 if max_query_len > 32 else 16
    grid = (batch, triton.cdiv(max_query_len, block_m), num_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        sinks if sinks is not None else out, out,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), scale * LOG2E,
        sliding_window or 0,
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, D_P=d_p,
        PAGE=page, BLOCK_M=block_m, BLOCK_N=64, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, PRECISION=_precision(q.dtype),
        num_warps=4 if d_p <= 64 else 8, num_stages=2,
        **pdl.launch_options(pdl.enabled(q.device)),
    )  # fmt: skip
    return out
