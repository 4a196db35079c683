"""Router top-k: which experts each token goes to, and with which weight."""

from __future__ import annotations

import torch

#: "softmax_topk": softmax over all experts (float32), then the top k (Mixtral, Qwen3-MoE;
#: ``renormalize`` makes the k weights sum to 1, Qwen3's ``norm_topk_prob``).
#: "topk_softmax": the top k logits, then a softmax over those k (GPT-OSS).
SCORING_FUNCTIONS = ("softmax_topk", "topk_softmax")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax_topk",
    renormalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k] int64) for logits [T, E], with
    transformers' arithmetic for each scoring function."""
    if scoring == "softmax_topk":
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(router_logits.dtype), ids
    if scoring == "topk_softmax":
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        weights = torch.softmax(values, dim=-1, dtype=values.dtype)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    raise ValueError(f"unknown MoE scoring {scoring!r}; supported: {list(SCORING_FUNCTIONS)}")
