"""Experts in the model dtype (bf16 / fp16 / fp32): W13 [E, 2 I_p, H] and W2 [E, H, I_p]."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantfw.kernels import moe
from quantfw.layers.moe.base import FusedMoEMethodBase, create_expert_biases, moe_param

#: the dummy loader draws these experts from U(-DUMMY_EXPERT_RANGE, DUMMY_EXPERT_RANGE), the rms
#: (0.0264) of the MXFP4 method's dummy experts (E2M1 codes under scales 2**-9 .. 2**-6), so a
#: bench's bf16-expert twin routes a batch as its MXFP4 model does. At the loader's +-1e-3 the
#: expert outputs vanish and a dummy model's greedy sequences collapse onto a few tokens: at
#: batch 16 GPT-OSS-20B's bf16 experts were read 6.6 of 32 a layer, its MXFP4 model's 27.2
#: (benchmarks/mxfp4-lab-log.md §24)
DUMMY_EXPERT_RANGE = 0.0456


def _dummy_experts(tensor: torch.Tensor, generator: torch.Generator) -> None:
    tensor.uniform_(-DUMMY_EXPERT_RANGE, DUMMY_EXPERT_RANGE, generator=generator)


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    def create_weights(  # type: ignore[override]
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        moe_param(
            layer,
            "w13_weight",
            torch.empty(e, 2 * i, h, dtype=params_dtype),
            moe_dim=1,
            fused=True,
            dummy_init=_dummy_experts,
            **extra,
        )
        moe_param(
            layer,
            "w2_weight",
            torch.empty(e, h, i, dtype=params_dtype),
            moe_dim=2,
            fused=False,
            dummy_init=_dummy_experts,
            **extra,
        )
        if layer.has_bias:
            create_expert_biases(layer, e, h, i, params_dtype, **extra)

    def apply(  # type: ignore[override]
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        w13_bias, w2_bias = layer.expert_biases()
        from quantfw.kernels.mxfp4 import grouped

        if grouped.gpu_available(x):
            return grouped.moe_forward(
                x, topk_weights, topk_ids,
                w13=grouped.DenseWeights(layer.w13_weight), w2=grouped.DenseWeights(layer.w2_weight),
                w13_bias=w13_bias, w2_bias=w2_bias, activation=layer.activation,
            )  # fmt: skip
        return moe.experts_forward_cpu(
            x, topk_weights, topk_ids,
            num_experts=layer.num_experts,
            expert_weights=lambda e: (layer.w13_weight[e].to(x.dtype), layer.w2_weight[e].to(x.dtype)),
            activation=layer.activation, w13_bias=w13_bias, w2_bias=w2_bias,
        )  # fmt: skip
