"""What every loader shares: building the model on its device and post-processing weights."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch
from torch import nn

from quantfw.config import LoadConfig, ModelConfig
from quantfw.layers.quantization.base import QuantizeMethodBase
from quantfw.models.registry import resolve_model_class


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def check_quantization_support(model_config: ModelConfig, device: torch.device) -> None:
    qc = model_config.quant_config
    if qc is None:
        return
    if model_config.dtype not in qc.get_supported_act_dtypes():
        raise ValueError(
            f"quantization method {qc.get_name()!r} does not support dtype {model_config.dtype}; "
            f"supported: {qc.get_supported_act_dtypes()}"
        )
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major * 10 + minor < qc.get_min_capability():
            raise ValueError(
                f"quantization method {qc.get_name()!r} needs compute capability "
                f">= {qc.get_min_capability()}, this GPU has {major}{minor}"
            )


def initialize_model(model_config: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The model class for the config's architecture, built with uninitialised parameters on
    `device` in the model dtype (use device "meta" to plan without memory)."""
    device = torch.device(device)
    model_cls, _ = resolve_model_class(model_config.architectures)
    qc = model_config.quant_config
    if qc is not None:
        check_quantization_support(model_config, device)
        qc.packed_modules_mapping = dict(getattr(model_cls, "packed_modules_mapping", {}))
    with torch.device(device), default_dtype(model_config.dtype):
        return model_cls(model_config.hf_config, quant_config=qc)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every quantization method repack the weights it owns."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)


class BaseModelLoader(ABC):
    def __init__(self, load_config: LoadConfig):
        self.load_config = load_config

    @abstractmethod
    def load_model(self, model_config: ModelConfig, device: torch.device) -> nn.Module:
        """A ready-to-run model (in eval mode) on `device`."""
