"""`toy_int8`: per-output-channel symmetric int8 weights.

Checkpoint tensors per linear layer: ``qweight [out, in] int8`` and ``weight_scale [out] fp32``;
``w = qweight * weight_scale[:, None]``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantfw.layers.linear import LinearBase
from quantfw.layers.quantization import (
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
)
from quantfw.layers.sharding import set_weight_attrs


class ToyInt8Config(QuantizationConfig):
    def __init__(self, modules_to_not_convert: list[str] | None = None):
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def get_name(cls) -> str:
        return "toy_int8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ToyInt8Config:
        if config.get("bits", 8) != 8:
            raise ValueError(f"toy_int8 supports bits=8 only, got {config['bits']}")
        return cls(config.get("modules_to_not_convert"))

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        if self.is_layer_skipped(prefix):
            return UnquantizedLinearMethod()
        return ToyInt8LinearMethod()


class ToyInt8LinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra,
    ):
        out = sum(output_partition_sizes)
        qweight = nn.Parameter(
            torch.empty(out, input_size_per_partition, dtype=torch.int8), requires_grad=False
        )
        set_weight_attrs(qweight, {"output_dim": 0, "input_dim": 1, **extra})
        scale = nn.Parameter(torch.empty(out, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, **extra})
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("weight_scale", scale)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = F.linear(x, layer.qweight.to(x.dtype)) * layer.weight_scale.to(x.dtype)
        return out if bias is None else out + bias
