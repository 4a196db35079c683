"""`load_model`: the one call from a checkpoint to a ready nn.Module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantfw import distributed as qdist
from quantfw.config import LoadConfig, ModelConfig
from quantfw.loaders import get_model_loader


def load_model_with_config(
    model: str,
    *,
    quantization: str | None = None,
    quantization_args: dict[str, Any] | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    load_format: str = "auto",
    revision: str | None = None,
    download_dir: str | None = None,
    tensor_parallel_size: int | None = None,
    max_model_len: int | None = None,
) -> tuple[ModelConfig, nn.Module]:
    """`load_model`, also returning the `ModelConfig` it resolved (the engine needs both)."""
    qdist.init_distributed(tensor_parallel_size)
    model_config = ModelConfig(
        model,
        revision=revision,
        dtype=dtype,
        quantization=quantization,
        quantization_args=quantization_args,
        max_model_len=max_model_len,
        download_dir=download_dir,
    )
    load_config = LoadConfig(load_format=load_format, download_dir=download_dir, revision=revision)
    target = torch.device(device) if device is not None else qdist.default_device()
    return model_config, get_model_loader(load_config).load_model(model_config, target)


def load_model(
    model: str,
    *,
    quantization: str | None = None,
    quantization_args: dict[str, Any] | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    load_format: str = "auto",
    revision: str | None = None,
    download_dir: str | None = None,
    tensor_parallel_size: int | None = None,
) -> nn.Module:
    """Load a HF checkpoint (local folder or hub repo id) into a quantfw model.

    The result is called as ``model(input_ids)`` with a [batch, seq] LongTensor and returns
    logits [batch, seq, vocab]. Under torchrun the tensor-parallel size defaults to the world size
    and every rank must call this; `device` defaults to ``cuda:LOCAL_RANK`` or the CPU.
    """
    return load_model_with_config(
        model,
        quantization=quantization,
        quantization_args=quantization_args,
        dtype=dtype,
        device=device,
        load_format=load_format,
        revision=revision,
        download_dir=download_dir,
        tensor_parallel_size=tensor_parallel_size,
    )[1]
