"""Router top-k: which experts each token goes to, and with which weight."""

from __future__ import annotations

import torch

from quantfw.kernels.common import triton_available

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
    transformers' arithmetic for each scoring function. CUDA logits take one Triton launch
    (`triton_routing.router_topk`; ties go to the lower expert id)."""
    if scoring not in SCORING_FUNCTIONS:
        raise ValueError(f"unknown MoE scoring {scoring!r}; supported: {list(SCORING_FUNCTIONS)}")
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"MoE top_k={top_k} must be in 1..{num_experts} (the router's experts)")
    if router_logits.is_cuda and router_logits.dim() == 2 and _triton_routes(num_experts):
        from quantfw.kernels.moe.triton_routing import router_topk

        return router_topk(router_logits, top_k, scoring == "softmax_topk", renormalize)
    if scoring == "softmax_topk":
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(router_logits.dtype), ids
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    weights = torch.softmax(values, dim=-1, dtype=values.dtype)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _triton_routes(num_experts: int) -> bool:
    if not triton_available():
        return False
    from quantfw.kernels.moe import triton_routing

    return num_experts <= triton_routing.MAX_EXPERTS
