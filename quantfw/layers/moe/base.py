"""The MoE quantize-method interface and how expert parameters describe their sharding."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, NamedTuple

import torch
from torch import nn

from quantfw.layers.quantization.base import QuantizeMethodBase
from quantfw.layers.sharding import set_weight_attrs


class ExpertShard(NamedTuple):
    """What one checkpoint tensor holds of a FusedMoE parameter (the shard id of an
    expert-parameter mapping entry).

    ``expert_id``: the expert, or None when the tensor holds every expert (leading dim E).
    ``part``: "w1" (gate), "w3" (up), "w2" (down), or "w13" (gate and up with interleaved rows:
    row 2j is gate j, row 2j+1 is up j, as GPT-OSS stores ``gate_up_proj``).
    ``transposed``: the tensor is stored [in, out] (GPT-OSS's bf16 ``gate_up_proj``/``down_proj``).
    """

    expert_id: int | None
    part: str
    transposed: bool = False


#: parts a fused gate/up parameter accepts, and those a down parameter accepts
W13_PARTS = ("w1", "w3", "w13")
W2_PARTS = ("w2",)


def moe_param(
    layer: nn.Module,
    name: str,
    data: torch.Tensor,
    *,
    moe_dim: int | None,
    fused: bool,
    units: int = 1,
    **attrs: Any,
) -> nn.Parameter:
    """Register expert parameter `name` on `layer` with its sharding facts: `moe_dim` is the
    dim running along the intermediate features (None: not sharded), holding `units` logical
    features per stored element; `fused` marks a [gate | up] parameter (the w13 side)."""
    param = nn.Parameter(data, requires_grad=False)
    set_weight_attrs(param, {"moe_dim": moe_dim, "moe_fused": fused, "moe_units": units, **attrs})
    layer.register_parameter(name, param)
    return param


def create_expert_biases(
    layer: nn.Module,
    num_experts: int,
    hidden_size: int,
    intermediate_size_per_partition: int,
    params_dtype: torch.dtype,
    **extra: Any,
) -> None:
    """``w13_bias [E, 2 I_p]`` (sharded with the intermediate dim) and ``w2_bias [E, H]``
    (whole on every rank, added on TP rank 0 only)."""
    e, h, i = num_experts, hidden_size, intermediate_size_per_partition
    moe_param(
        layer, "w13_bias", torch.empty(e, 2 * i, dtype=params_dtype), moe_dim=1, fused=True, **extra
    )
    moe_param(
        layer, "w2_bias", torch.empty(e, h, dtype=params_dtype), moe_dim=None, fused=False, **extra
    )


class FusedMoEMethodBase(QuantizeMethodBase):
    """Creates, repacks and applies every expert's weights of a `FusedMoE` layer at once, as a
    linear method does for one matrix. W13 holds [gate | up] (each ``I_p`` rows) per expert, W2
    the down projection; ``I_p`` is the layer's padded per-rank intermediate size."""

    #: the per-rank intermediate size is padded to a multiple of this (quantization blocks)
    intermediate_alignment: int = 1

    @abstractmethod
    def create_weights(  # type: ignore[override]
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        """Register the experts' parameters (via `moe_param`; biases via `create_expert_biases`
        when ``layer.has_bias``)."""

    @abstractmethod
    def apply(  # type: ignore[override]
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's partial MoE output [T, H] for x [T, H] routed to `topk_ids` [T, k] with
        `topk_weights` (the layer all-reduces it); ``w2_bias`` counts on TP rank 0 only."""

    def runtime_nbytes(self, layer: nn.Module) -> int:
        own = list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False))
        return sum(t.numel() * t.element_size() for t in own)
