"""GPTQ (AutoGPTQ / GPTQModel checkpoints): 2/3/4/8-bit codes packed along the input dim.

On disk, per linear layer (``I`` input, ``O`` output features, ``G`` groups, ``b`` bits):
``qweight [I*b/32, O] int32`` (bit stream along the input dim), ``qzeros [G, O*b/32] int32``
(bit stream along the output dim), ``scales [G, O] fp16``, ``g_idx [I] int32`` (group of each
input row; a permutation of groups under act-order). ``W[i, o] = (q[i, o] - z[g_idx[i], o]) *
s[g_idx[i], o]``, where the "gptq" (v1) format stores ``z - 1`` and "gptq_v2" stores ``z``.

Tensor parallelism with act-order (``desc_act``): a Row-parallel shard of the input rows holds
rows of every group, so ``g_idx`` is sharded with the input and ``scales``/``qzeros`` are kept
whole on every rank. Without act-order, ``scales``/``qzeros`` are sharded by whole groups.
"""

from __future__ import annotations

import math
from fractions import Fraction
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

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_PARAMS = ("qweight", "qzeros", "scales", "g_idx")


class GPTQConfig(QuantizationConfig):
    """``quant_method: gptq``; reads ``bits``, ``group_size``, ``desc_act``, ``sym``,
    ``checkpoint_format`` and ``modules_to_not_convert``."""

    def __init__(
        self,
        *,
        bits: int = 4,
        group_size: int = 128,
        desc_act: bool = False,
        sym: bool = True,
        checkpoint_format: str = "gptq",
        modules_to_not_convert: list[str] | None = None,
    ):
        if bits not in reference.SUPPORTED_GPTQ_BITS:
            raise ValueError(
                f"GPTQ: bits={bits} is not supported; supported: "
                f"{list(reference.SUPPORTED_GPTQ_BITS)} (4 runs fused, the others dequantize)"
            )
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"GPTQ: group_size={group_size} is invalid; use a positive size or -1")
        checkpoint_format = str(checkpoint_format).lower()
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"GPTQ: checkpoint_format={checkpoint_format!r} is not supported; supported: "
                f"{list(CHECKPOINT_FORMATS)}"
            )
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @property
    def zero_offset(self) -> int:
        """Added to stored zeros: the v1 format stores ``z - 1``."""
        return 1 if self.checkpoint_format == "gptq" else 0

    @property
    def pack_factor(self) -> int | Fraction:
        """Codes per int32 (32/3 for 3 bits, whose codes straddle words)."""
        factor = Fraction(32, self.bits)
        return int(factor) if factor.denominator == 1 else factor

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        pack_dtype = config.get("pack_dtype")
        if pack_dtype not in (None, "int32", "torch.int32"):
            raise ValueError(f"GPTQ: pack_dtype={pack_dtype!r} is not supported; supported: int32")
        if config.get("lm_head"):
            raise ValueError(
                "GPTQ: lm_head=true (a quantized LM head) is not supported; supported: false "
                "(the head in the model dtype)"
            )
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        return cls(
            bits=int(config.get("bits", 4)),
            group_size=int(config.get("group_size", 128)),
            desc_act=bool(config.get("desc_act", False)),
            sym=bool(config.get("sym", True)),
            checkpoint_format=str(fmt),
            modules_to_not_convert=config.get("modules_to_not_convert"),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from quantfw.layers.linear import LinearBase

        if not isinstance(layer, LinearBase):
            return None
        if self.is_layer_skipped(prefix):
            return UnquantizedLinearMethod()
        return GPTQLinearMethod(self)

    def __repr__(self) -> str:
        return (
            f"GPTQConfig(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act}, "
            f"sym={self.sym}, checkpoint_format={self.checkpoint_format})"
        )


class GPTQLinearMethod(LinearMethodBase):
    def __init__(self, config: GPTQConfig):
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
        cfg = self.config
        bits, group_size = cfg.bits, cfg.group_size
        word = 32 // math.gcd(32, bits)  # codes per whole number of int32 words
        why = f"GPTQ packs {bits}-bit codes into int32 words and a shard would split one"
        for size in output_partition_sizes:
            check_divisible(layer, "output size per partition", size, word, why)
        check_divisible(layer, "input size per partition", input_size_per_partition, word, why)
        in_sharded = input_size_per_partition != input_size
        groups_sharded = group_size != -1 and not cfg.desc_act
        if groups_sharded and in_sharded:
            check_divisible(
                layer,
                "input size per partition",
                input_size_per_partition,
                group_size,
                f"a tensor-parallel shard would split a quantization group (group_size "
                f"{group_size})",
            )
        if group_size == -1:
            num_groups = 1
        elif groups_sharded:
            num_groups = math.ceil(input_size_per_partition / group_size)
        else:
            num_groups = math.ceil(input_size / group_size)
        out = sum(output_partition_sizes)
        group_attrs = {"input_dim": 0} if groups_sharded else {}
        tensors = {
            "qweight": (
                torch.empty(input_size_per_partition * bits // 32, out, dtype=torch.int32),
                {"input_dim": 0, "output_dim": 1, "packed_dim": 0, "pack_factor": cfg.pack_factor},
            ),
            "qzeros": (
                torch.empty(num_groups, out * bits // 32, dtype=torch.int32),
                {**group_attrs, "output_dim": 1, "packed_dim": 1, "pack_factor": cfg.pack_factor},
            ),
            "scales": (
                torch.empty(num_groups, out, dtype=params_dtype),
                {**group_attrs, "output_dim": 1},
            ),
        }
        dummy = {"qzeros": {"dummy_init": self._dummy_qzeros}}
        for name, (data, attrs) in tensors.items():
            param = nn.Parameter(data, requires_grad=False)
            set_weight_attrs(param, {**attrs, **extra, **dummy.get(name, {})})
            layer.register_parameter(name, param)

        # the first group of this rank's rows when scales are sharded by whole groups
        first = input_size_per_partition * layer.tp_rank if in_sharded else 0
        layer.gptq_group_offset = first // group_size if groups_sharded else 0
        layer.gptq_num_groups = num_groups
        g_idx = nn.Parameter(
            torch.empty(input_size_per_partition, dtype=torch.int32), requires_grad=False
        )

        def dummy_g_idx(full: torch.Tensor, generator: torch.Generator) -> None:
            """The full g_idx: contiguous groups, under act-order a random permutation of them."""
            groups = reference.group_index(input_size, group_size, full.device)
            if cfg.desc_act:
                groups = groups[torch.randperm(input_size, generator=generator, device=full.device)]
            full.copy_(groups)

        set_weight_attrs(
            g_idx,
            {
                "input_dim": 0,
                "weight_loader": extra["weight_loader"],
                "dummy_init": dummy_g_idx,
            },
        )
        layer.register_parameter("g_idx", g_idx)

    def _dummy_qzeros(self, full: torch.Tensor, generator: torch.Generator) -> None:
        """Zero points a real checkpoint could hold: 2**(bits-1) when symmetric, any code
        otherwise; stored minus one in the v1 format, whose stored zeros are 0..2**bits-2."""
        cfg = self.config
        shape = (full.shape[0], full.shape[1] * 32 // cfg.bits)
        if cfg.sym:
            codes = torch.full(shape, 2 ** (cfg.bits - 1) - cfg.zero_offset, device=full.device)
        else:
            high = 2**cfg.bits - cfg.zero_offset
            codes = torch.randint(0, high, shape, generator=generator, device=full.device)
        full.copy_(reference.pack_int32(codes, cfg.bits, dim=1))

    def _local_groups(self, layer: nn.Module) -> torch.Tensor:
        g = layer.g_idx.data.long() - layer.gptq_group_offset
        num_groups = layer.scales.shape[0]
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= num_groups):
            raise ValueError(
                f"layer {layer.prefix}: g_idx refers to groups outside "
                f"[{layer.gptq_group_offset}, {layer.gptq_group_offset + num_groups}) held by "
                f"this rank (min {int(g.min()) + layer.gptq_group_offset}, max "
                f"{int(g.max()) + layer.gptq_group_offset}); is desc_act=false set for an "
                "act-order checkpoint?"
            )
        return g

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        cfg = self.config
        g = self._local_groups(layer)
        qweight, qzeros, scales = layer.qweight.data, layer.qzeros.data, layer.scales.data
        if cfg.bits == 4 and int4.w4a16_available(qweight.device, scales.dtype):
            packed = w4a16.repack_gptq(
                qweight,
                qzeros,
                scales,
                g,
                cfg.group_size,
                sym=cfg.sym,
                checkpoint_format=cfg.checkpoint_format,
                dtype=scales.dtype,
            )
            int4.attach_w4a16(layer, packed, _PARAMS)
            return
        if cfg.bits != 4 or not torch_ops.fused_int4_available(qweight.device):
            # apply dequantizes on the fly with the rank's local groups
            kept = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
            replace_with_buffers(layer, _PARAMS, {**kept, "g_idx": g.to(torch.int32)})
            return
        codes = reference.unpack_int32(qweight, 4, dim=0)
        zeros = reference.unpack_int32(qzeros, 4, dim=1) + cfg.zero_offset
        int4.attach_int4pack(layer, codes, zeros, scales, g, scales.dtype, _PARAMS)

    def runtime_nbytes(self, layer: nn.Module) -> int:
        k, n = layer.input_size_per_partition, layer.output_size_per_partition
        bits, groups = self.config.bits, layer.gptq_num_groups
        checkpoint = (
            k * bits // 32 * n * 4
            + groups * n * bits // 32 * 4
            + groups * n * layer.params_dtype.itemsize
            + k * 4
        )
        return int4.runtime_nbytes(layer, checkpoint)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = int4.apply_packed(layer, x, bias)
        if out is not None:
            return out
        weight = reference.dequantize_gptq(
            layer.qweight,
            layer.qzeros,
            layer.scales,
            layer.g_idx,
            self.config.bits,
            zero_offset=self.config.zero_offset,
        )
        return F.linear(x, weight.t().to(x.dtype), bias)
