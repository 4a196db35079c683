"""Experts in the model dtype (bf16 / fp16 / fp32): W13 [E, 2 I_p, H] and W2 [E, H, I_p]."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantfw.kernels import moe
from quantfw.layers.moe.base import FusedMoEMethodBase, create_expert_biases, moe_param


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
            **extra,
        )
        moe_param(
            layer,
            "w2_weight",
            torch.empty(e, h, i, dtype=params_dtype),
            moe_dim=2,
            fused=False,
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
