"""RMSNorm as transformers computes it (fp32 statistics; the weight applied in the input dtype,
or in float32 before one rounding for GPT-OSS), optionally fused with the residual add before it
(`quantfw.kernels.fused`)."""

from __future__ import annotations

import torch
from torch import nn

from quantfw.kernels import fused
from quantfw.layers.sharding import copy_shard, set_weight_attrs


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        params_dtype: torch.dtype | None = None,
        weight_in_float32: bool = False,
    ):
        """`weight_in_float32`: scale by the weight in float32 and round once (GPT-OSS) instead
        of rounding the normalized input first (Llama); the two differ in bf16/fp16."""
        super().__init__()
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"weight_loader": _load_whole, "dummy_init": _dummy_weight})

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with `residual`: ``(norm(x + residual), x + residual)``."""
        return fused.rms_norm(
            x, self.weight, self.eps, residual, weight_in_float32=self.weight_in_float32
        )

    def extra_repr(self) -> str:
        extra = ", weight_in_float32" if self.weight_in_float32 else ""
        return f"{tuple(self.weight.shape)}, eps={self.eps}{extra}"


def _dummy_weight(full: torch.Tensor, generator: torch.Generator) -> None:
    """The dummy loader's values: near one, like a fresh model's, so normalised activations keep
    their unit scale (tiny random norm weights would shrink every layer's output to nothing)."""
    full.uniform_(0.5, 1.5, generator=generator)


def _load_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    copy_shard(param, loaded, dim=None)
