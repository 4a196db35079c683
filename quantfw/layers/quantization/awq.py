"""AWQ (GEMM version, as written by AutoAWQ): 4-bit asymmetric, groups along the input.

On disk, per linear layer (``I`` input, ``O`` output features, ``G`` groups):
``qweight [I, O/8] int32`` and ``qzeros [G, O/8] int32`` packed along the output dim in the
interleaved order of `quantfw.kernels.reference.AWQ_PACK_ORDER`; ``scales [G, O] fp16``.
``W[i, o] = (q[i, o] - z[i // group_size, o]) * s[i // group_size, o]``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantfw.kernels import reference, torch_ops, w4a16
from quantfw.layers.quantization import int4
from quantfw.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedLinearMethod,
    check_divisible,
    replace_with_buffers,
)
from quantfw.layers.sharding import set_weight_attrs

AWQ_PACK_FACTOR = 8
_PARAMS = ("qweight", "qzeros", "scales")


def _first(config: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


class AWQConfig(QuantizationConfig):
    """``quant_method: awq``; reads ``bits``/``w_bit``, ``group_size``/``q_group_size``,
    ``zero_point``, ``version`` and ``modules_to_not_convert``."""

    def __init__(
        self,
        *,
        bits: int = 4,
        group_size: int = 128,
        zero_point: bool = True,
        version: str = "gemm",
        modules_to_not_convert: list[str] | None = None,
    ):
        if bits != 4:
            raise ValueError(f"AWQ: bits={bits} is not supported; supported: 4")
        if group_size != -1 and group_size <= 0:
            raise ValueError(
                f"AWQ: group_size={group_size} is invalid; use a positive size "
                "(32, 64, 128 are usual) or -1 for one group per output column"
            )
        if not zero_point:
            raise ValueError(
                "AWQ: zero_point=false is not supported; AWQ GEMM checkpoints store qzeros "
                "(supported: zero_point=true)"
            )
        if str(version).lower() != "gemm":
            raise ValueError(
                f"AWQ: version={version!r} is not supported; supported: 'gemm' (re-export GEMV, "
                "GEMV_fast, Marlin or ExLlama AWQ checkpoints in the GEMM layout)"
            )
        self.bits = bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.version = "gemm"
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        return cls(
            bits=int(_first(config, ("bits", "w_bit"), 4)),
            group_size=int(_first(config, ("group_size", "q_group_size"), 128)),
            zero_point=bool(_first(config, ("zero_point",), True)),
            version=str(_first(config, ("version",), "gemm")),
            modules_to_not_convert=_first(config, ("modules_to_not_convert",), None),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from quantfw.layers.linear import LinearBase

        if not isinstance(layer, LinearBase):
            return None
        if self.is_layer_skipped(prefix):
            return UnquantizedLinearMethod()
        return AWQLinearMethod(self)

    def __repr__(self) -> str:
        return f"AWQConfig(bits={self.bits}, group_size={self.group_size}, version=gemm)"


class AWQLinearMethod(LinearMethodBase):
    def __init__(self, config: AWQConfig):
        self.config = config

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        group_size = self.config.group_size
        for size in output_partition_sizes:
            check_divisible(
                layer,
                "output size per partition",
                size,
                AWQ_PACK_FACTOR,
                "AWQ packs 8 output features per int32 and a shard would split one",
            )
        if group_size == -1:
            num_groups, group_attrs = 1, {}  # one group: scales/zeros shared by every rank
        else:
            check_divisible(
                layer,
                "input size per partition",
                input_size_per_partition,
                group_size,
                f"a tensor-parallel shard would split a quantization group (group_size "
                f"{group_size})",
            )
            num_groups, group_attrs = input_size_per_partition // group_size, {"input_dim": 0}
        out = sum(output_partition_sizes)
        packed = {"output_dim": 1, "packed_dim": 1, "pack_factor": AWQ_PACK_FACTOR}
        tensors = {
            "qweight": (
                torch.empty(input_size_per_partition, out // 8, dtype=torch.int32),
                {"input_dim": 0, **packed},
            ),
            "qzeros": (
                torch.empty(num_groups, out // 8, dtype=torch.int32),
                {**group_attrs, **packed},
            ),
            "scales": (
                torch.empty(num_groups, out, dtype=params_dtype),
                {**group_attrs, "output_dim": 1},
            ),
        }
        for name, (data, attrs) in tensors.items():
            param = nn.Parameter(data, requires_grad=False)
            set_weight_attrs(param, {**attrs, **extra})
            layer.register_parameter(name, param)
        layer.awq_group_size = group_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, qzeros, scales = layer.qweight.data, layer.qzeros.data, layer.scales.data
        if int4.w4a16_available(qweight.device, scales.dtype):
            # the Triton kernels read AWQ's own layout: no repack of the weight
            packed = w4a16.repack_awq(qweight, qzeros, scales, layer.awq_group_size, scales.dtype)
            int4.attach_w4a16(layer, packed, _PARAMS)
            return
        if not torch_ops.fused_int4_available(qweight.device):
            # apply dequantizes on the fly
            replace_with_buffers(
                layer, _PARAMS, {"qweight": qweight, "qzeros": qzeros, "scales": scales}
            )
            return
        codes = reference.unpack_awq(qweight)
        zeros = reference.unpack_awq(qzeros)
        g_idx = reference.group_index(codes.shape[0], layer.awq_group_size, codes.device)
        int4.attach_int4pack(layer, codes, zeros, scales, g_idx, scales.dtype, _PARAMS)

    def runtime_nbytes(self, layer: nn.Module) -> int:
        k, n = layer.input_size_per_partition, layer.output_size_per_partition
        groups = 1 if layer.awq_group_size == -1 else k // layer.awq_group_size
        checkpoint = k * n // 2 + groups * n // 2 + groups * n * layer.params_dtype.itemsize
        return int4.runtime_nbytes(layer, checkpoint)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = int4.apply_packed(layer, x, bias)
        if out is not None:
            return out
        weight = reference.dequantize_awq(
            layer.qweight, layer.qzeros, layer.scales, layer.awq_group_size
        )
        return F.linear(x, weight.t().to(x.dtype), bias)
