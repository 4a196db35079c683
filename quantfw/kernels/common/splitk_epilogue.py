"""The device side of split-K in one launch (Triton): `common.splitk` plans the split and owns
the workspace and arrival counters; a kernel's CTAs end with `add_partial`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_partial(acc, ws_ptr, offs, mask, cnt_ptr, n_split):
    """Add this CTA's partial sums ``acc`` into the fp32 workspace at ``offs`` and bump the
    tile's arrival counter ``cnt_ptr`` (one of ``n_split`` CTAs). Returns ``(last, sums)``: in
    the CTA that arrives last, ``last`` is true and ``sums`` holds the tile's totals; that CTA
    has written zeros back and reset the counter, so the buffers are clean for the next launch
    (or CUDA-graph replay)."""
    tl.atomic_add(ws_ptr + offs, acc, mask=mask, sem="relaxed")
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    last = ticket == n_split - 1
    sums = acc
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
        # after the acquiring ticket every CTA's adds have landed in L2: read them past L1; an
        # element of the layout may live in several threads, so all read before any writes
        sums = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.debug_barrier()
        tl.store(ws_ptr + offs, tl.zeros_like(sums), mask=mask)
    return last, sums
