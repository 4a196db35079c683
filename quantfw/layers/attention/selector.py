"""Which attention backend runs a model's cache-aware steps."""

from __future__ import annotations

import torch

from quantfw.kernels.common import triton_available
from quantfw.layers.attention.backends.base import AttentionBackend
from quantfw.layers.attention.backends.flashinfer import (
    FLASHINFER_DTYPES,
    FlashInferBackend,
    flashinfer_available,
)
from quantfw.layers.attention.backends.sdpa import SDPABackend

BACKENDS = ("auto", "sdpa", "triton", "flashinfer")


def select_backend(
    name: str, device: torch.device, dtype: torch.dtype, *, uses_sinks: bool = False
) -> AttentionBackend:
    """``"auto"``: on CUDA our Triton kernels (when Triton is installed), else SDPA; ``"sdpa"``
    (the reference, any device), ``"triton"`` (CUDA) or ``"flashinfer"`` (CUDA, fp16/bf16, no
    attention sinks)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if name == "sdpa":
        return SDPABackend()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device; use 'sdpa'")
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package")
        from quantfw.layers.attention.backends.triton import TritonBackend

        return TritonBackend()
    if name == "flashinfer":
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(
                f"attention_backend='flashinfer' needs a float16 or bfloat16 model, got {dtype}; "
                "use attention_backend='triton' or 'sdpa'"
            )
        if device.type != "cuda":
            raise ValueError("attention_backend='flashinfer' needs a CUDA device")
        if uses_sinks:
            raise ValueError(
                "attention_backend='flashinfer' does not support attention sinks; "
                "use attention_backend='triton' or 'sdpa'"
            )
        if not flashinfer_available():
            raise ValueError(
                "attention_backend='flashinfer' needs flashinfer (pip install quantfw[flashinfer])"
            )
        return FlashInferBackend(device)
    raise ValueError(f"unknown attention_backend {name!r}; supported: {', '.join(BACKENDS)}")
