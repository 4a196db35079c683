"""GPT-OSS: a Llama-shaped decoder with attention sinks, sliding-window attention on the layers
``layer_types`` marks ``sliding_attention``, YaRN rope, biases on q/k/v/o, RMSNorms that scale
by their weight in float32 before rounding, and MoE MLPs (a router with bias: top-k logits then
softmax; experts with biases and a clamped SwiGLU whose gate and up rows are interleaved in the
checkpoint).

Checkpoint experts: ``mlp.experts.gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` (bf16,
stored [in, out]) or their MXFP4 form ``gate_up_proj_blocks [E, 2I, H/32, 16]`` +
``_scales``, ``down_proj_blocks [E, H, I/32, 16]`` + ``_scales``; ``gate_up_proj_bias [E, 2I]``
and ``down_proj_bias [E, H]`` either way."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from quantfw.layers.activation import SwigluOAIAndMul
from quantfw.layers.linear import ReplicatedLinear
from quantfw.layers.moe import ExpertShard, FusedMoE
from quantfw.layers.quantization.base import QuantizationConfig
from quantfw.models.llama import LlamaForCausalLM, _join

#: (parameter part, checkpoint part, shard): every expert in one tensor; gate/up interleaved
_EXPERTS: list[tuple[str, str, Any]] = [
    ("experts.w13_weight", "experts.gate_up_proj", ExpertShard(None, "w13", transposed=True)),
    ("experts.w2_weight", "experts.down_proj", ExpertShard(None, "w2", transposed=True)),
    ("experts.w13_blocks", "experts.gate_up_proj_blocks", ExpertShard(None, "w13")),
    ("experts.w13_scales", "experts.gate_up_proj_scales", ExpertShard(None, "w13")),
    ("experts.w2_blocks", "experts.down_proj_blocks", ExpertShard(None, "w2")),
    ("experts.w2_scales", "experts.down_proj_scales", ExpertShard(None, "w2")),
    ("experts.w13_bias", "experts.gate_up_proj_bias", ExpertShard(None, "w13")),
    ("experts.w2_bias", "experts.down_proj_bias", ExpertShard(None, "w2")),
]


class GptOssMLP(nn.Module):
    def __init__(self, config: Any, *, quant_config: QuantizationConfig | None, prefix: str):
        super().__init__()
        self.router = ReplicatedLinear(
            config.hidden_size, config.num_local_experts, bias=True, prefix=_join(prefix, "router")
        )
        self.experts = FusedMoE(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            activation=SwigluOAIAndMul(
                getattr(config, "swiglu_alpha", 1.702), getattr(config, "swiglu_limit", 7.0)
            ),
            bias=True,
            scoring="topk_softmax",
            quant_config=quant_config,
            prefix=_join(prefix, "experts"),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router(hidden))


class GptOssForCausalLM(LlamaForCausalLM):
    stacked_params_mapping: ClassVar[list[tuple[str, str, Any]]] = [
        *_EXPERTS,
        *LlamaForCausalLM.stacked_params_mapping,
        ("self_attn.attn.sinks", "self_attn.sinks", None),
    ]
    norm_weight_in_float32: ClassVar[bool] = True

    @classmethod
    def attention_options(cls, config: Any, layer_index: int) -> dict[str, Any]:
        layer_types = getattr(config, "layer_types", None) or []
        sliding = layer_index < len(layer_types) and layer_types[layer_index] == "sliding_attention"
        return {"sliding_window": config.sliding_window if sliding else None, "use_sinks": True}

    @classmethod
    def build_mlp(
        cls, config: Any, layer_index: int, *, quant_config: QuantizationConfig | None, prefix: str
    ) -> nn.Module:
        return GptOssMLP(config, quant_config=quant_config, prefix=prefix)
