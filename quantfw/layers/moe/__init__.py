"""Mixture-of-experts layers: `FusedMoE` and the MoE quantize-method interface."""

from quantfw.layers.moe.base import (
    ExpertShard,
    FusedMoEMethodBase,
    create_expert_biases,
    moe_param,
)
from quantfw.layers.moe.layer import FusedMoE, expert_params_mapping
from quantfw.layers.moe.unquantized import UnquantizedFusedMoEMethod

__all__ = [
    "ExpertShard",
    "FusedMoE",
    "FusedMoEMethodBase",
    "UnquantizedFusedMoEMethod",
    "create_expert_biases",
    "expert_params_mapping",
    "moe_param",
]
