"""Gated activations: ``act(gate) * up`` of a gated pair's [gate | up] output (columns
optionally interleaved in groups, see `fused.silu_and_mul`)."""

from __future__ import annotations

import torch
from torch import nn

from quantfw.kernels import fused


class GatedActivation(nn.Module):
    """An activation of a gated pair, described by ``spec`` so that a linear method may
    compute it inside its GEMM (`LinearMethodBase.apply_gated`)."""

    spec: fused.GatedAct

    def forward(self, x: torch.Tensor, interleave: int = 0) -> torch.Tensor:
        return self.spec(x, interleave)


class SiluAndMul(GatedActivation):
    """``silu(gate) * up`` for an input of width 2d (gate then up)."""

    spec = fused.GatedAct("silu")


class SwigluOAIAndMul(GatedActivation):
    """GPT-OSS's clamped SwiGLU on an input of width 2d (gate then up): ``(clamp(up, -limit,
    limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``."""

    def __init__(self, alpha: float = 1.702, limit: float | None = 7.0):
        super().__init__()
        self.spec = fused.GatedAct("swiglu_oai", alpha, limit)

    def extra_repr(self) -> str:
        return f"alpha={self.spec.alpha}, limit={self.spec.limit}"
