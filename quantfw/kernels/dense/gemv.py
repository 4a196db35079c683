"""One-token matmul of a dense fp16/bf16 weight (``y = x @ W.T + b``, x one row) in one Triton
launch. A CTA takes ``BN`` output rows and a range of K, ``BK`` inputs a step: its first
step's weights are loaded before the programmatic-dependent-launch wait (they overlap the end of
the previous kernel), each later step's before the current one is multiplied, and products
gather in a ``[BN, BK]`` float32 tile summed across K once, at the end. When K is split over
several CTAs, each stores its partial sums in its own row of the shared self-cleaning workspace
(`common.splitk`) and the last CTA of a column tile sums them in a fixed order (the same bits
every run: a replicated router gives every tensor-parallel rank the same experts), adds the
bias and stores.

With a `ops.QkvRopeStore` the launch is a decode step's q/k/v projection whose output goes where
attention reads it: its epilogue rotates q and k (rotate-half rotary over whole heads), writes q
to the output and k and v to the token's cache row, so no separate rotary-and-store launch sits
between the projection and the decode attention. A CTA's ``BN`` rows are then ``BN / 2`` rotary
pairs (rows ``j`` and ``j + head_dim / 2`` of a head) in the q and k part, plain rows in the v
part.

On an H100 (2026-11-25, `benchmarks/probe_dense_gemv.py`) it runs GPT-OSS-20B's and Qwen3-8B's
one-token projections and LM heads at 0.95-1.25x their copy-bandwidth floor, 1.05-1.45x
faster than cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.common import pdl, splitk
from quantfw.kernels.common.splitk_epilogue import ordered_sum
from quantfw.kernels.dense.ops import QkvRopeStore


@triton.jit
def _dense_gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    stride_wn,
    k_per_split,
    cs_ptr,  # ROPE: float32 [head_dim], cos of the head_dim / 2 frequencies, then sin
    slot_ptr,  # ROPE: int32 or int64 [1], the token's cache row
    k_cache,  # ROPE: the flat key and value caches, [rows, KV_ROWS]
    v_cache,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    SPLIT_P: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROPE: tl.constexpr = False,
    Q_ROWS: tl.constexpr = 0,
    KV_ROWS: tl.constexpr = 0,
    HEAD_DIM: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    pdl.triton_release(PDL)
    pid_n = tl.program_id(0)
    sp = tl.program_id(1)
    n = _tile_rows(pid_n, BN, ROPE, Q_ROWS + KV_ROWS, HEAD_DIM)
    nmask = n < N
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    # k_per_split is a multiple of BK, so the splits' steps never overlap and masking at K
    # (not at k_end) is exact
    k0 = sp * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    # the first step's weights go out before the wait (no kernel writes them); each later
    # step loads the next step's weights before multiplying this one's
    kk = k0 + tl.arange(0, BK)
    w = tl.load(rows + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :], other=0.0,
                eviction_policy="evict_first")  # fmt: skip
    pdl.triton_wait(PDL)
    acc = tl.zeros([BN, BK], tl.float32)  # summed across K once, after the loop
    for k in range(k0 + BK, k_end, BK):
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        kk = k + tl.arange(0, BK)
        w_next = tl.load(rows + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :], other=0.0,
                         eviction_policy="evict_first")  # fmt: skip
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    acc += w.to(tl.float32) * x[None, :]
    sums = tl.sum(acc, axis=1)
    if SPLIT > 1:  # a reproducible sum: replicated layers (routers) agree across TP ranks
        last, sums = ordered_sum(sums, ws_ptr, n, nmask, N, sp, cnt_ptr + pid_n, SPLIT, SPLIT_P)
        if last:
            _store(sums, bias_ptr, out_ptr, n, nmask, HAS_BIAS, cs_ptr, slot_ptr, k_cache,
                   v_cache, ROPE, Q_ROWS, KV_ROWS, HEAD_DIM)  # fmt: skip
    else:
        _store(sums, bias_ptr, out_ptr, n, nmask, HAS_BIAS, cs_ptr, slot_ptr, k_cache, v_cache,
               ROPE, Q_ROWS, KV_ROWS, HEAD_DIM)  # fmt: skip


@triton.jit
def _tile_rows(pid_n, BN: tl.constexpr, ROPE: tl.constexpr, ROT_ROWS: tl.constexpr,
               HEAD_DIM: tl.constexpr):  # fmt: skip
    """The output rows of column tile ``pid_n``: ``BN`` consecutive rows, or with ``ROPE`` in
    the first ``ROT_ROWS`` (q and k) rotary pairs: element ``2 a + b`` of the tile is half
    ``b`` of pair ``pid_n BN / 2 + a`` (a head's rows ``j`` and ``j + HEAD_DIM / 2``)."""
    r = tl.arange(0, BN)
    if ROPE:
        half: tl.constexpr = HEAD_DIM // 2
        pair = pid_n * (BN // 2) + r // 2
        rot = pair // half * HEAD_DIM + pair % half + (r % 2) * half
        return tl.where(pid_n * BN < ROT_ROWS, rot, pid_n * BN + r)
    return pid_n * BN + r


@triton.jit
def _store(
    acc, bias_ptr, out_ptr, n, nmask, HAS_BIAS: tl.constexpr, cs_ptr, slot_ptr, k_cache,
    v_cache, ROPE: tl.constexpr, Q_ROWS: tl.constexpr, KV_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Bias, rounding to the output dtype, and the store: at ``n`` of the output, or with
    ``ROPE`` q rows rotated into the output, k rows rotated and v rows as they are into the
    cache row (the arithmetic of `fused.qk_norm_rope`: rotated from the rounded values in
    float32, rounded again)."""
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    if ROPE:
        BN: tl.constexpr = acc.shape[0]
        half: tl.constexpr = HEAD_DIM // 2
        y = acc.to(dt).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(y, [BN // 2, 2]))
        # the pair's first row, within its head
        j = tl.min(tl.reshape(n, [BN // 2, 2]), axis=1) % HEAD_DIM
        c = tl.load(cs_ptr + j, mask=j < half, other=1.0)
        s = tl.load(cs_ptr + half + j, mask=j < half, other=0.0)
        rot = tl.reshape(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), [BN])
        y = tl.where(n < Q_ROWS + KV_ROWS, rot, y).to(dt)
        row = tl.load(slot_ptr).to(tl.int64) * KV_ROWS
        tl.store(out_ptr + n, y, mask=nmask & (n < Q_ROWS))
        is_k = (n >= Q_ROWS) & (n < Q_ROWS + KV_ROWS)
        tl.store(k_cache + row + (n - Q_ROWS), y.to(k_cache.dtype.element_ty), mask=nmask & is_k)
        is_v = n >= Q_ROWS + KV_ROWS
        tl.store(v_cache + row + (n - Q_ROWS - KV_ROWS), y.to(v_cache.dtype.element_ty),
                 mask=nmask & is_v)  # fmt: skip
    else:
        tl.store(out_ptr + n, acc.to(dt), mask=nmask)


def dense_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 4,
    block_k: int = 512,
    ctas_per_sm: int = 8,
    warps: int = 2,
    rope_store: QkvRopeStore | None = None,
) -> torch.Tensor:
    """``x [1, K] @ weight[N, K].T (+ bias)`` -> ``[1, N]`` in x's dtype (the weight's rows
    contiguous); the split along K fills ``ctas_per_sm`` CTAs of ``block_n`` columns per SM.
    With ``rope_store`` only the rotated q is written: ``[1, num_heads * head_dim]`` (k and v
    go to the caches)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"dense_gemv: x must be [1, {weight.shape[1]}] for weight {tuple(weight.shape)}, "
            f"got {tuple(x.shape)}"
        )
    if weight.stride(1) != 1:
        raise ValueError("dense_gemv: the weight's rows must be contiguous")
    N, K = weight.shape
    x = x.contiguous()
    rs = rope_store
    # with the epilogue only q is written to the output (k and v go to the caches)
    out_rows = N if rs is None else rs.num_heads * rs.head_dim
    out = torch.empty(1, out_rows, dtype=x.dtype, device=x.device)
    if rs is not None:
        rs.check(weight, block_n)
        rope_args = (rs.cos_sin, rs.slot, rs.k_cache, rs.v_cache)
        rope_consts = dict(ROPE=True, Q_ROWS=rs.num_heads * rs.head_dim,
                           KV_ROWS=rs.num_kv_heads * rs.head_dim, HEAD_DIM=rs.head_dim)  # fmt: skip
    else:
        rope_args, rope_consts = (out, out, out, out), {}
    tiles = triton.cdiv(N, block_n)
    split, n_iter = splitk.split_plan(
        triton.cdiv(K, block_k), tiles, splitk.num_sms(x.device), ctas_per_sm
    )
    # without a split the kernel touches neither buffer: take them as they are, ungrown
    ws, cnt = (
        splitk.workspace(x.device, split * N, tiles)
        if split > 1
        else splitk.workspace(x.device, 1, 1)
    )
    _dense_gemv_kernel[(tiles, split)](
        x, weight, bias if bias is not None else out, out, ws, cnt, N, K, weight.stride(0),
        n_iter * block_k, *rope_args, BN=block_n, BK=block_k, SPLIT=split,
        SPLIT_P=triton.next_power_of_2(split), HAS_BIAS=bias is not None, **rope_consts,
        num_warps=warps, **pdl.launch_options(pdl.enabled(x.device)),
    )  # fmt: skip
    return out
