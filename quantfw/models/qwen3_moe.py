"""Qwen3-MoE: the Qwen3 decoder whose MLPs are mixtures of experts (softmax over all experts,
top-k, ``norm_topk_prob`` renormalisation), except layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` that keep a dense MLP. Checkpoints store one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``) and the router as ``mlp.gate``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantfw.layers.linear import ReplicatedLinear
from quantfw.layers.moe import FusedMoE, expert_params_mapping
from quantfw.layers.quantization.base import QuantizationConfig
from quantfw.models.llama import _join
from quantfw.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, config: Any, *, quant_config: QuantizationConfig | None, prefix: str):
        super().__init__()
        # the router stays in the model dtype whatever the quantization (as in vLLM)
        self.gate = ReplicatedLinear(
            config.hidden_size, config.num_experts, bias=False, prefix=_join(prefix, "gate")
        )
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            scoring="softmax_topk",
            renormalize=bool(config.norm_topk_prob),
            quant_config=quant_config,
            prefix=_join(prefix, "experts"),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """transformers' rule: a MoE block unless listed in mlp_only_layers or off the sparse step."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_index not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_index + 1) % step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def build_mlp(
        cls, config: Any, layer_index: int, *, quant_config: QuantizationConfig | None, prefix: str
    ) -> nn.Module:
        if is_sparse_layer(config, layer_index):
            return Qwen3MoeSparseBlock(config, quant_config=quant_config, prefix=prefix)
        return super().build_mlp(config, layer_index, quant_config=quant_config, prefix=prefix)

    def params_mapping(self) -> list[tuple[str, str, Any]]:
        return expert_params_mapping(self.config.num_experts) + self.stacked_params_mapping
