"""The CPU path of a MoE layer: one expert at a time, each expert's weights materialised (e.g.
dequantized) only while its tokens run, never all experts at once."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from quantfw.kernels.moe.sort import combine, sort_by_expert


def experts_forward_cpu(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_experts: int,
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    activation: Callable[[torch.Tensor], torch.Tensor],
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j w[t, j] * (act(x[t] @ W13[e].T + b13[e]) @ W2[e].T + b2[e])`` over the experts
    ``e = topk_ids[t, j]``. `expert_weights(e)` returns (W13 [2I, H], W2 [H, I]) in x's dtype;
    W13 holds [gate | up] and `activation` maps [.., 2I] -> [.., I]."""
    sort = sort_by_expert(topk_ids, num_experts)
    rows = x.new_empty(sort.token_index.numel(), x.shape[-1])
    bounds = sort.m_indptr.tolist()
    for e in range(num_experts):
        start, end = bounds[e], bounds[e + 1]
        if start == end:
            continue
        w13, w2 = expert_weights(e)
        h = F.linear(x[sort.token_index[start:end]], w13, None if w13_bias is None else w13_bias[e])
        rows[start:end] = F.linear(activation(h), w2, None if w2_bias is None else w2_bias[e])
    return combine(rows, sort, topk_weights)
