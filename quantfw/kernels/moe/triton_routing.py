"""Router top-k in one Triton launch: ``routing.select_experts`` for CUDA logits.

torch's path launches a softmax, ``topk`` (a radix select and a sort of the k winners) and the
casts: four to six kernels per MoE layer, about 9 us a layer of a batch-1 decode step on an
H100 (`benchmarks/mxfp4-lab-log.md` §6). Here one program takes ``ROWS`` tokens and picks their k
experts by k passes of a row max over the experts not yet taken (ties: the lower expert id
first), ranking the logits themselves (softmax preserves their order), then computes the
weights as `routing.select_experts` does for each scoring function.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.common import pdl

#: experts one program holds in registers (its row tile is ROWS x E_P logits)
MAX_EXPERTS = 1024
_TILE = 4096  # ROWS * E_P


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    T,
    E,
    stride_t,
    TOP_K: tl.constexpr,
    E_P: tl.constexpr,
    ROWS: tl.constexpr,
    SOFTMAX_FIRST: tl.constexpr,  # "softmax_topk": probabilities of all experts, then top k
    RENORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.wait_and_release(PDL)
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    e = tl.arange(0, E_P)
    tmask = t < T
    x = tl.load(
        logits_ptr + t[:, None] * stride_t + e[None, :],
        mask=tmask[:, None] & (e[None, :] < E),
        other=float("-inf"),
    ).to(tl.float32)
    # the k picks: rank[t, e] = j if expert e is token t's (j+1)-th choice, else -1; each pick
    # is the largest expert not yet taken (NaN ranks highest, as in torch.topk; padding never),
    # so the k ids are distinct real experts even when fewer than k logits are finite
    key = tl.where(x != x, float("inf"), x)
    real = e[None, :] < E
    rank = tl.full([ROWS, E_P], -1, tl.int32)
    for j in tl.static_range(TOP_K):
        free = real & (rank < 0)
        m = tl.max(tl.where(free, key, float("-inf")), axis=1)
        idx = tl.min(tl.where(free & (key == m[:, None]), e[None, :], E_P), axis=1)
        rank = tl.where(e[None, :] == idx[:, None], j, rank)
        tl.store(ids_ptr + t * TOP_K + j, idx.to(tl.int64), mask=tmask)
    chosen = rank >= 0
    top = tl.max(x, axis=1)
    p = tl.exp(x - top[:, None])
    if SOFTMAX_FIRST:  # softmax over every expert, in float32
        w = p / tl.sum(p, axis=1)[:, None]
    else:  # softmax over the k chosen logits, rounded to the logits' dtype
        w = p / tl.sum(tl.where(chosen, p, 0.0), axis=1)[:, None]
        w = w.to(weights_ptr.dtype.element_ty).to(tl.float32)
    if RENORM:  # w / sum of the k: float32 after softmax_topk, the logits' dtype otherwise
        total = tl.sum(tl.where(chosen, w, 0.0), axis=1)
        if not SOFTMAX_FIRST:
            total = total.to(weights_ptr.dtype.element_ty).to(tl.float32)
        w = w / total[:, None]
    for j in tl.static_range(TOP_K):
        wj = tl.sum(tl.where(rank == j, w, 0.0), axis=1)
        tl.store(weights_ptr + t * TOP_K + j, wj.to(weights_ptr.dtype.element_ty), mask=tmask)


def router_topk(
    router_logits: torch.Tensor, top_k: int, softmax_first: bool, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k] int64) for logits ``[T, E]`` on
    CUDA, E <= `MAX_EXPERTS`; the arithmetic of `routing.select_experts`."""
    T, E = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    e_p = triton.next_power_of_2(E)
    rows = max(1, min(16, _TILE // e_p, triton.next_power_of_2(T)))
    _router_topk_kernel[(triton.cdiv(T, rows),)](
        logits, weights, ids, T, E, logits.stride(0),
        TOP_K=top_k, E_P=e_p, ROWS=rows, SOFTMAX_FIRST=softmax_first, RENORM=renormalize,
        num_warps=4 if rows * e_p >= 1024 else 1,
        **pdl.launch_options(pdl.enabled(logits.device)),
    )  # fmt: skip
    return weights, ids
