"""Random weights with the right shapes and dtypes, for benchmarks without a checkpoint."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from quantfw.config import ModelConfig
from quantfw.loaders.base import BaseModelLoader, initialize_model, process_weights_after_loading


def fill_dummy(param: torch.Tensor, name: str, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill deterministically from the parameter's name, on the CPU, so every TP rank (and every
    device) draws the same numbers. A parameter may carry ``dummy_init(param, generator)`` when
    random bits would be invalid (e.g. group indices)."""
    generator = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode()))
    custom = getattr(param, "dummy_init", None)
    if custom is not None:
        custom(param, generator)
        return
    if param.dtype.is_floating_point:
        values = torch.empty(param.shape, dtype=torch.float32).uniform_(
            low, high, generator=generator
        )
    elif param.dtype == torch.bool:
        values = torch.randint(0, 2, param.shape, generator=generator).bool()
    else:
        info = torch.iinfo(param.dtype)
        values = torch.randint(
            info.min, info.max, param.shape, generator=generator, dtype=torch.int64
        )
    param.data.copy_(values.to(param.dtype))


class DummyModelLoader(BaseModelLoader):
    def load_model(self, model_config: ModelConfig, device: torch.device) -> nn.Module:
        model = initialize_model(model_config, device)
        with torch.no_grad():
            for name, param in model.named_parameters():
                fill_dummy(param, name)
        process_weights_after_loading(model)
        return model.eval()
