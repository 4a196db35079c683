"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from quantfw.kernels import fused


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for an input of width 2d (gate then up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.silu_and_mul(x)


class SwigluOAIAndMul(nn.Module):
    """GPT-OSS's clamped SwiGLU on an input of width 2d (gate then up): ``(clamp(up, -limit,
    limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``."""

    def __init__(self, alpha: float = 1.702, limit: float | None = 7.0):
        super().__init__()
        self.alpha = alpha
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.swiglu_oai(x, self.alpha, self.limit)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"
