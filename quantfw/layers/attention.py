"""Attention through torch SDPA (causal, grouped-query)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal self-attention over q [b, s, h, d], k/v [b, s, kv_h, d]; returns [b, s, h*d]."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = q.shape[:2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
