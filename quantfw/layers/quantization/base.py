"""Contracts every quantization method implements (see docs/plugins.md)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quantfw.kernels.dense import ops as dense_ops
from quantfw.kernels.dense.ops import QkvRopeStore
from quantfw.layers.sharding import set_weight_attrs


class QuantizeMethodBase(ABC):
    """Creates a layer's parameters, post-processes them after loading, and runs the layer."""

    @abstractmethod
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
        """Register parameters on `layer` with their sharding facts (see layers/sharding.py)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Repack loaded tensors into the layout `apply` wants. Default: nothing to do."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Compute the layer's output for activations `x` of shape [..., input_size_per_partition]."""

    def runtime_nbytes(self, layer: nn.Module) -> int:
        """Bytes of the tensors `layer` keeps for its weight after process_weights_after_loading
        (bias excluded), from the layer's sizes and the method's layout: what memory accounting
        can expect its parameters and buffers to hold."""
        raise NotImplementedError(f"{type(self).__name__} does not report runtime_nbytes")


def create_layer_weights(
    layer: nn.Module,
    input_size_per_partition: int,
    output_partition_sizes: list[int],
    params_dtype: torch.dtype,
    weight_loader: Any,
) -> None:
    """Record this rank's sizes on `layer` (which holds ``input_size``, ``output_size`` and
    ``quant_method``) and let its method register the weights, loaded by `weight_loader`: how
    every layer that takes its weight from a linear method (the linear layers, the LM head)
    creates it."""
    layer.input_size_per_partition = input_size_per_partition
    layer.output_partition_sizes = output_partition_sizes
    layer.output_size_per_partition = sum(output_partition_sizes)
    layer.quant_method.create_weights(
        layer,
        input_size_per_partition,
        output_partition_sizes,
        layer.input_size,
        layer.output_size,
        params_dtype,
        weight_loader=weight_loader,
    )


def check_divisible(layer: nn.Module, what: str, size: int, divisor: int, why: str) -> None:
    """Raise a clear error when a per-rank size would split a group or a packed int32."""
    if size % divisor:
        tp = getattr(layer, "tp_size", 1)
        raise ValueError(
            f"layer {getattr(layer, 'prefix', '') or '(root)'}: {what} {size} (tensor_parallel_size "
            f"{tp}) is not a multiple of {divisor}: {why}"
        )


def replace_with_buffers(
    layer: nn.Module, drop: tuple[str, ...], buffers: dict[str, torch.Tensor | None]
) -> None:
    """Drop the checkpoint-layout parameters `drop` of `layer` and register `buffers` (runtime
    tensors; None is allowed) as non-persistent buffers, so ``model.to()``, ``named_buffers()``
    and memory accounting see them and state dicts do not."""
    for name in drop:
        delattr(layer, name)
    for name, tensor in buffers.items():
        layer.register_buffer(name, tensor, persistent=False)


_KEPT = "_quant_runtime"


def kept_runtime(layer: nn.Module, key: str, source: torch.Tensor, make: Callable[[], Any]) -> Any:
    """One runtime object per layer and `key` over the layer's buffers (a weight wrapper on
    which kernels keep TMA descriptors and tables), kept across calls: eager calls would
    otherwise rebuild it each time. Made again when `source`, its first buffer, was replaced;
    dropped when the layer is moved or cast (`RuntimeKeeper`)."""
    kept = layer.__dict__.setdefault(_KEPT, {})
    entry = kept.get(key)
    if entry is None or entry[0] is not source:
        entry = kept[key] = (source, make())
    return entry[1]


class RuntimeKeeper(nn.Module):
    """Base of the layers whose quantize methods keep runtime objects (`kept_runtime`):
    ``module.to()``, ``.cuda()``, ``.half()`` (torch's ``_apply``) drop them, so the buffers
    they wrap are freed with the layer's old tensors rather than at its next call."""

    def _apply(self, fn, recurse=True):
        self.__dict__.pop(_KEPT, None)
        return super()._apply(fn, recurse)


class LinearMethodBase(QuantizeMethodBase):
    """A method for linear layers."""

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, act: nn.Module
    ) -> torch.Tensor:
        """``act`` (a `layers.activation.GatedActivation`) of the output of a gated pair
        layer (``[gate | up]``, `MergedColumnParallelLinear` with ``gated=True``). Default:
        `apply`, then the activation; a method may compute it inside its GEMM."""
        return act(self.apply(layer, x, bias))

    def apply_rope_store(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, store: QkvRopeStore
    ) -> torch.Tensor | None:
        """A q/k/v projection of one decode token that also rotates q and k and writes k and v
        to their cache row (`store`), returning the rotated q; None (the default) where the
        method does not fuse it and the caller rotates and stores after `apply`."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain `weight [out, in]` in the model dtype."""

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
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra})
        layer.register_parameter("weight", weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dense_ops.linear(x, layer.weight, bias)

    def apply_rope_store(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, store: QkvRopeStore
    ) -> torch.Tensor | None:
        return dense_ops.linear_rope_store(x, layer.weight, bias, store)

    def runtime_nbytes(self, layer: nn.Module) -> int:
        return layer.weight.numel() * layer.weight.element_size()


class QuantizationConfig(ABC):
    """A quantization method's settings, read from a checkpoint's `quantization_config`."""

    #: Layer prefixes (or name parts) that stay unquantized.
    modules_to_not_convert: list[str] = []
    #: Linear-layer names fused by the model (e.g. qkv_proj -> q/k/v); set by the loader.
    packed_modules_mapping: dict[str, list[str]] = {}
    #: Whether the checkpoint's config.json names this method (its tensors are quantized);
    #: False for a dense checkpoint loaded with ``quantization=...``, which a method that
    #: quantizes while loading (kbit) serves. Set by resolve_quantization_config.
    checkpoint_is_quantized: bool = True

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The name used in `quant_method`."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from the HF dict; reject what this method cannot serve with a clear error."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for `layer` (None means unquantized)."""

    @classmethod
    def get_min_capability(cls) -> int:
        """Minimum CUDA compute capability as major*10+minor (0: any, including CPU)."""
        return 0

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    def is_layer_skipped(self, prefix: str) -> bool:
        """True when `prefix` (or every part of a fused layer) is in `modules_to_not_convert`."""
        return is_layer_skipped(prefix, self.modules_to_not_convert, self.packed_modules_mapping)


def _matches(prefix: str, pattern: str) -> bool:
    """`pattern` is a whole run of dotted name parts inside `prefix`; a pattern with ``*`` is a
    regex matched from the start of `prefix` up to a part boundary, as transformers reads
    ``modules_to_not_convert`` (GPT-OSS lists ``model.layers.*.self_attn``)."""
    if "*" in pattern:
        return re.match(rf"(?:{pattern})(?:\.|$)", prefix) is not None
    return ("." + pattern + ".") in ("." + prefix + ".")


def is_layer_skipped(
    prefix: str, ignored: list[str], packed_modules_mapping: dict[str, list[str]]
) -> bool:
    """Whether a layer stays unquantized. A fused layer is skipped only if all its parts are;
    a mix is an error, because one fused tensor cannot be half quantized."""
    if not ignored:
        return False
    head, _, leaf = prefix.rpartition(".")
    parts = packed_modules_mapping.get(leaf)
    if not parts:
        return any(_matches(prefix, p) for p in ignored)
    part_prefixes = [f"{head}.{p}" if head else p for p in parts]
    skipped = [any(_matches(pp, p) for p in ignored) for pp in part_prefixes]
    if any(skipped) and not all(skipped):
        raise ValueError(
            f"layer {prefix!r} fuses {parts}, but modules_to_not_convert skips only some of them "
            f"({[pp for pp, s in zip(part_prefixes, skipped) if s]}); all parts must agree"
        )
    return all(skipped)
