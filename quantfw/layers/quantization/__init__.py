"""The quantization method registry and detection from HF configs.

Built-in methods are registered lazily by name; third-party ones through the entry point group
``quantfw.quantization_methods`` (entry point name = method name, object = the
`QuantizationConfig` subclass) or the `register_quantization_method` decorator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quantfw.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedLinearMethod,
    is_layer_skipped,
)
from quantfw.registry import Registry

__all__ = [
    "QUANTIZATION_METHODS",
    "LinearMethodBase",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "UnquantizedLinearMethod",
    "get_quantization_config_class",
    "is_layer_skipped",
    "register_quantization_method",
    "resolve_quantization_config",
]

QUANTIZATION_METHODS = Registry(
    "quantization method", "quantfw.quantization_methods", case_insensitive=True
)

#: Built-in methods, imported on first use.
_BUILTIN: dict[str, str] = {
    "awq": "quantfw.layers.quantization.awq:AWQConfig",
    "gptq": "quantfw.layers.quantization.gptq:GPTQConfig",
    "kbit": "quantfw.layers.quantization.kbit:KbitConfig",
    "mxfp4": "quantfw.layers.quantization.mxfp4:Mxfp4Config",
}
for _name, _target in _BUILTIN.items():
    QUANTIZATION_METHODS.register(_name, _target)


def register_quantization_method(
    name: str,
) -> Callable[[type[QuantizationConfig]], type[QuantizationConfig]]:
    """Class decorator: make a `QuantizationConfig` subclass available as `quant_method: name`."""

    def wrap(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
            raise TypeError(f"{cls!r} registered as {name!r} is not a QuantizationConfig subclass")
        QUANTIZATION_METHODS.register(name, cls)
        return cls

    return wrap


def get_quantization_config_class(name: str) -> type[QuantizationConfig]:
    """The config class registered as `name` (case-insensitive)."""
    try:
        cls = QUANTIZATION_METHODS.get(name)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
        raise TypeError(f"quantization method {name!r} maps to {cls!r}, not a QuantizationConfig")
    return cls


def resolve_quantization_config(
    checkpoint_config: dict[str, Any] | None,
    quantization: str | None = None,
    quantization_args: dict[str, Any] | None = None,
) -> QuantizationConfig | None:
    """Pick the method from the checkpoint's `quantization_config.quant_method` and/or the user's
    `quantization`; the user's `quantization_args` are merged over the checkpoint's dict."""
    checkpoint_config = dict(checkpoint_config or {})
    from_checkpoint = checkpoint_config.get("quant_method")
    if from_checkpoint is not None:
        from_checkpoint = str(from_checkpoint).lower()
    if quantization is not None:
        quantization = quantization.lower()
    if quantization and from_checkpoint and quantization != from_checkpoint:
        raise ValueError(
            f"quantization={quantization!r} was asked for, but the checkpoint's config.json says "
            f"quant_method={from_checkpoint!r}; drop the argument or use a matching checkpoint"
        )
    name = quantization or from_checkpoint
    if name is None:
        if quantization_args:
            raise ValueError("quantization_args were given without a quantization method")
        return None
    cls = get_quantization_config_class(name)
    merged = {**checkpoint_config, **(quantization_args or {}), "quant_method": name}
    config = cls.from_config(merged)
    if not config.modules_to_not_convert and merged.get("modules_to_not_convert"):
        config.modules_to_not_convert = list(merged["modules_to_not_convert"])
    config.checkpoint_is_quantized = from_checkpoint is not None
    return config
