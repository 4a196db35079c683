"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from quantfw.kernels import fused


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for an input of width 2d (gate then up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.silu_and_mul(x)
