"""The device side of split-K in one launch (Triton): `common.splitk` plans the split and owns
the workspace and arrival counters; a kernel's CTAs end with `add_partial` (atomic adds into
one ``[M, N]`` workspace tile: any split, summed in arrival order) or `ordered_sum` (a row per
CTA, summed in a fixed order: the same bits every run, for layers every tensor-parallel rank
computes whole, such as a MoE router)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _arrive(cnt_ptr, n_split):
    """After every thread of the CTA has written its partial: bump the tile's arrival counter
    with an acquiring ticket; true in the last of ``n_split`` CTAs, which resets the counter."""
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    last = ticket == n_split - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
    return last


@triton.jit
def add_partial(acc, ws_ptr, offs, mask, cnt_ptr, n_split):
    """Add this CTA's partial sums ``acc`` into the fp32 workspace at ``offs`` and bump the
    tile's arrival counter ``cnt_ptr`` (one of ``n_split`` CTAs). Returns ``(last, sums)``: in
    the CTA that arrives last, ``last`` is true and ``sums`` holds the tile's totals; that CTA
    has written zeros back and reset the counter, so the buffers are clean for the next launch
    (or CUDA-graph replay)."""
    tl.atomic_add(ws_ptr + offs, acc, mask=mask, sem="relaxed")
    last = _arrive(cnt_ptr, n_split)
    sums = acc
    if last:
        # after the acquiring ticket every CTA's adds have landed in L2: read them past L1; an
        # element of the layout may live in several threads, so all read before any writes
        sums = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.debug_barrier()
        tl.store(ws_ptr + offs, tl.zeros_like(sums), mask=mask)
    return last, sums


@triton.jit
def ordered_sum(acc, ws_ptr, n, mask, N, sp, cnt_ptr, SPLIT: tl.constexpr, SPLIT_P: tl.constexpr):
    """Split-K with a sum that has the same bits whatever order the CTAs finish in: CTA
    ``sp`` (of SPLIT; SPLIT_P its power of two) stores its partial ``acc`` of columns ``n`` in
    its own workspace row (``ws[sp * N + n]``) and bumps the tile's counter; the last to arrive
    sums the SPLIT rows in one fixed order and writes zeros back. Returns ``(last, sums)`` as
    `add_partial` does. The workspace must hold ``SPLIT * N`` floats."""
    tl.store(ws_ptr + sp * N + n, acc, mask=mask)
    last = _arrive(cnt_ptr, SPLIT)
    sums = acc
    if last:
        s = tl.arange(0, SPLIT_P)
        rows = ws_ptr + s[:, None] * N + n[None, :]
        rows_mask = (s < SPLIT)[:, None] & mask[None, :]
        parts = tl.load(rows, mask=rows_mask, other=0.0, cache_modifier=".cg")
        sums = tl.sum(parts, axis=0)
        tl.debug_barrier()
        tl.store(rows, tl.zeros_like(parts), mask=rows_mask)
    return last, sums
