"""kbit: K-bit (K = 2..5) codebook quantization in blocks of 32 input features, E4M4 block
scales, indices stored as K bit-plane words per block (format: `quantfw.kernels.kbit.format`,
docs/formats.md).

Two ways in:

* a kbit checkpoint (config.json ``quantization_config.quant_method: "kbit"``), per linear layer
  ``kbit_planes int32 [O, I/32, K]``, ``kbit_absmax uint8 [O, I/32]`` and ``kbit_codebook
  float32 [2**K]`` (written by ``quantfw quantize --method kbit``);
* a dense checkpoint loaded with ``quantization="kbit", quantization_args={"bits": K}``: each
  linear layer's ``weight`` parameter holds the bit planes, and its weight loader quantizes
  every checkpoint tensor (or fused part) as it arrives, on the parameter's device, so no
  dense copy of the model is ever held.

With ``lm_head: true`` the untied LM head is quantized too, as one more such layer
(``lm_head.kbit_*``, vocabulary rows along dim 0).

Both load through the layer's own weight loader (`layers/sharding.py` narrows the quantized
tensors: blocks along the input dim, so a Row shard must hold whole blocks). After loading the
planes are repacked into the kernels' field-packed layout (`quantfw.kernels.kbit.layout`) and kept as
non-persistent buffers ``kbit_qweight``, ``kbit_scales``, ``kbit_codebook``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantfw.kernels import fused, kbit
from quantfw.kernels.kbit import format as kfmt
from quantfw.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedLinearMethod,
    check_divisible,
    kept_runtime,
    replace_with_buffers,
)
from quantfw.layers.sharding import set_weight_attrs

#: E4M4 codes the dummy loader draws for block scales: absmax 2**-10 .. 2**-7 (1e-3 .. 8e-3)
_DUMMY_ABSMAX_CODES = (16, 64)


class KbitConfig(QuantizationConfig):
    """``quant_method: kbit``; reads ``bits`` (2, 3, 4 or 5; required), ``blocksize`` (32),
    ``codebook`` (``"normal_float"``, the default, or a list of ``2**bits`` ascending levels),
    ``absmax_format`` (``"e4m4"``), ``lm_head`` (false, the default; true: the untied LM head is
    quantized too, as GPTQ's ``lm_head`` option does) and ``modules_to_not_convert``."""

    def __init__(
        self,
        *,
        bits: int,
        blocksize: int = kfmt.BLOCKSIZE,
        codebook: list[float] | str | None = None,
        lm_head: bool = False,
        modules_to_not_convert: list[str] | None = None,
    ):
        self.bits = kfmt.check_bits(bits)
        self.blocksize = kfmt.check_blocksize(blocksize)
        if not isinstance(lm_head, bool):
            raise ValueError(f"kbit: lm_head={lm_head!r} is not supported; use true or false")
        self.lm_head = lm_head
        if codebook is None or codebook == "normal_float":
            self.codebook = kfmt.normal_float_codebook(bits)
            self.custom_codebook = False
        elif isinstance(codebook, str):
            raise ValueError(
                f"kbit: codebook={codebook!r} is not supported; use 'normal_float' or a list of "
                f"{1 << bits} ascending levels"
            )
        else:
            self.codebook = kfmt.check_codebook(codebook, bits, "kbit: codebook")
            self.custom_codebook = True
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def get_name(cls) -> str:
        return "kbit"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> KbitConfig:
        if config.get("bits") is None:
            raise ValueError(
                f"kbit: bits is required (quantization_args={{'bits': K}}, on the command line "
                f"--quantization-args '{{\"bits\": K}}'); supported: {list(kfmt.SUPPORTED_BITS)}"
            )
        absmax_format = config.get("absmax_format", "e4m4")
        if absmax_format != "e4m4":
            raise ValueError(
                f"kbit: absmax_format={absmax_format!r} is not supported; supported: 'e4m4'"
            )
        return cls(
            bits=config["bits"],
            blocksize=config.get("blocksize", kfmt.BLOCKSIZE),
            codebook=config.get("codebook"),
            lm_head=config.get("lm_head", False),
            modules_to_not_convert=config.get("modules_to_not_convert"),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from quantfw.layers.linear import LinearBase
        from quantfw.layers.vocab import ParallelLMHead

        if isinstance(layer, ParallelLMHead):
            if not self.lm_head:
                return None
        elif not isinstance(layer, LinearBase):
            return None
        if self.is_layer_skipped(prefix):
            return UnquantizedLinearMethod()
        return KbitLinearMethod(self)

    def __repr__(self) -> str:
        cb = "custom" if self.custom_codebook else "normal_float"
        source = "checkpoint" if self.checkpoint_is_quantized else "quantized while loading"
        head = ", lm_head" if self.lm_head else ""
        return (
            f"KbitConfig(bits={self.bits}, blocksize={self.blocksize}, codebook={cb}{head}, "
            f"{source})"
        )


def _checked_loader(loader: Callable, what: str, dtype: torch.dtype | None) -> Callable:
    """`loader` behind a dtype check of the checkpoint tensor (uint32 planes are read as their
    int32 bit pattern; a codebook of any float dtype is converted)."""

    def load(param: torch.Tensor, loaded: torch.Tensor, *shard_id: Any) -> None:
        if dtype == torch.int32 and loaded.dtype == torch.uint32:
            loaded = loaded.view(torch.int32)
        if dtype is None and not loaded.is_floating_point():
            raise ValueError(f"{what} must be floating point, got {loaded.dtype}")
        if dtype is not None and loaded.dtype != dtype:
            raise ValueError(f"{what} must be {dtype}, got {loaded.dtype}")
        loader(param, loaded, *shard_id)

    return load


class KbitLinearMethod(LinearMethodBase):
    def __init__(self, config: KbitConfig):
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
        bits = self.config.bits
        check_divisible(
            layer,
            "input size per partition",
            input_size_per_partition,
            kfmt.BLOCKSIZE,
            f"kbit quantizes blocks of {kfmt.BLOCKSIZE} input features and a shard would split one",
        )
        out, blocks = sum(output_partition_sizes), input_size_per_partition // kfmt.BLOCKSIZE
        loader = extra.pop("weight_loader")
        blocked = {"output_dim": 0, "input_dim": 1, "packed_dim": 1, "pack_factor": kfmt.BLOCKSIZE}
        planes = torch.empty(out, blocks, bits, dtype=torch.int32)
        absmax = torch.empty(out, blocks, dtype=torch.uint8)
        codebook = self.config.codebook.clone()

        def dummy_planes(param: torch.Tensor, generator: torch.Generator) -> None:
            words = torch.randint(
                -(2**31), 2**31 - 1, param.shape, generator=generator, dtype=torch.int32,
                device=param.device,
            )  # fmt: skip
            param.data.copy_(words)

        def dummy_absmax(param: torch.Tensor, generator: torch.Generator) -> None:
            codes = torch.randint(
                *_DUMMY_ABSMAX_CODES, param.shape, generator=generator, device=param.device
            )
            param.data.copy_(codes.to(torch.uint8))

        def dummy_codebook(param: torch.Tensor, generator: torch.Generator) -> None:
            param.data.copy_(self.config.codebook)

        if self.config.checkpoint_is_quantized:
            params = {
                "kbit_planes": (planes, blocked, torch.int32, dummy_planes),
                "kbit_absmax": (absmax, blocked, torch.uint8, dummy_absmax),
                "kbit_codebook": (codebook, {}, None, dummy_codebook),
            }
            for name, (data, attrs, dtype, dummy) in params.items():
                param = nn.Parameter(data, requires_grad=False)
                what = f"layer {layer.prefix or '(root)'}: {name}"
                set_weight_attrs(
                    param,
                    {
                        **attrs,
                        **extra,
                        "weight_loader": _checked_loader(loader, what, dtype),
                        "dummy_init": dummy,
                    },
                )
                layer.register_parameter(name, param)
            return
        # a dense checkpoint: `weight` holds the planes; its loader quantizes what arrives and
        # places planes and absmax through the layer's loader
        layer.register_buffer("kbit_absmax", absmax, persistent=False)
        layer.register_buffer("kbit_codebook", codebook, persistent=False)
        set_weight_attrs(layer.kbit_absmax, blocked)
        weight = nn.Parameter(planes, requires_grad=False)

        def quantizing_loader(param: torch.Tensor, loaded: torch.Tensor, *shard_id: Any) -> None:
            part = f" part {shard_id[0]!r}" if shard_id else ""
            what = f"layer {layer.prefix or '(root)'}{part}"
            if loaded.dim() != 2 or loaded.shape[1] != input_size:
                raise ValueError(
                    f"{what}: a dense weight [out, {input_size}] was expected for kbit "
                    f"quantization, got {list(loaded.shape)}"
                )
            q_planes, q_absmax = kfmt.quantize(
                loaded.to(param.device), bits, self.config.codebook, name=f"{what} weight"
            )
            loader(param, q_planes, *shard_id)
            loader(layer.kbit_absmax, q_absmax, *shard_id)

        set_weight_attrs(
            weight,
            {
                **blocked,
                **extra,
                "weight_loader": quantizing_loader,
                # the dummy loader draws the dense TP=1 weight and loads it like a checkpoint's
                "checkpoint_spec": ((output_size, input_size), params_dtype),
            },
        )
        layer.register_parameter("weight", weight)

    def _flat(self, layer: nn.Module) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(planes' name, planes, absmax, codebook) as loaded."""
        name = "kbit_planes" if self.config.checkpoint_is_quantized else "weight"
        return name, getattr(layer, name).data, layer.kbit_absmax.data, layer.kbit_codebook.data

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        prefix = layer.prefix or "(root)"
        name, planes, absmax, codebook = self._flat(layer)
        codebook = kfmt.check_codebook(codebook, self.config.bits, f"layer {prefix}: kbit_codebook")
        if self.config.custom_codebook and not torch.equal(codebook, self.config.codebook):
            raise ValueError(
                f"layer {prefix}: kbit_codebook {codebook.tolist()} differs from the codebook "
                f"of the quantization config {self.config.codebook.tolist()}"
            )
        group = _gated_interleave(layer)
        if group:  # the GEMM's epilogue activates a block's gate and up halves (kbit.ops)
            planes = fused.interleave_gate_up(planes, group)
            absmax = fused.interleave_gate_up(absmax, group)
            if layer.bias is not None:
                layer.bias.data = fused.interleave_gate_up(layer.bias.data, group)
        weight = kbit.repack_weight(planes, absmax, codebook, f"layer {prefix}")
        replace_with_buffers(
            layer,
            (name, "kbit_absmax", "kbit_codebook"),
            {
                "kbit_qweight": weight.qweight,
                "kbit_scales": weight.scales,
                "kbit_codebook": weight.codebook,
            },
        )
        layer.kbit_features = (weight.in_features, weight.out_features)
        layer.kbit_gate_up_interleave = group

    def runtime_nbytes(self, layer: nn.Module) -> int:
        return kbit.tiled_nbytes(
            layer.output_size_per_partition, layer.input_size_per_partition, self.config.bits
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if getattr(layer, "kbit_qweight", None) is None:  # not repacked yet: the flat tensors
            _, planes, absmax, codebook = self._flat(layer)
            weight = kfmt.dequantize(planes, absmax, codebook).reshape(planes.shape[0], -1)
            return F.linear(x, weight.to(x.dtype), bias)
        out = kbit.kbit_matmul(x, self._weight(layer), bias)
        group = layer.kbit_gate_up_interleave
        return fused.deinterleave_gate_up(out, group) if group else out

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, act: nn.Module
    ) -> torch.Tensor:
        group = getattr(layer, "kbit_gate_up_interleave", 0)
        if not group:
            return super().apply_gated(layer, x, bias, act)
        return kbit.kbit_matmul(x, self._weight(layer), bias, act=(act.spec, group))

    @staticmethod
    def _weight(layer: nn.Module) -> kbit.KbitWeight:
        """The layer's `KbitWeight`, kept across calls (`kept_runtime`: the kernels cache
        per-weight tables and TMA descriptors on it)."""
        return kept_runtime(
            layer, "kbit", layer.kbit_qweight,
            lambda: kbit.KbitWeight(
                layer.kbit_qweight, layer.kbit_scales, layer.kbit_codebook, *layer.kbit_features
            ),
        )  # fmt: skip


def _gated_interleave(layer: nn.Module) -> int:
    """The row interleave of a gated pair's repacked weight (`fused.interleave_gate_up`): the
    mma kernel's gated group where each part's rows per rank are whole groups, else 0."""
    if not getattr(layer, "gated", False):
        return 0
    part = layer.output_partition_sizes[0]
    return kbit.GATED_GROUP if part % kbit.GATED_GROUP == 0 else 0
