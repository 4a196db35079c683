"""The interface every attention backend implements."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantfw.layers.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from quantfw.layers.attention.layer import Attention


class AttentionBackend:
    """Cache-aware attention. `prepare` runs once per step (inside a CUDA graph when one is
    captured, so it must not sync with the host), `forward` once per layer: it stores the new
    keys/values at the step's slot mapping and attends over each sequence's cached context,
    honouring the layer's `sliding_window` and `sinks`.

    ``forward(layer, q [T, heads, head_dim], k/v [T, kv_heads, head_dim], meta)`` returns
    ``[T, heads * head_dim]`` in q's dtype.
    """

    name = "base"
    #: whether `forward` may run inside a captured CUDA graph (fixed shapes, no host syncs)
    graph_capturable = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers."""

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError


def store_kv(layer: Attention, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write this step's k/v [T, kv_heads, head_dim] at flat cache rows `slots` [T] (torch ops)."""
    k_cache, v_cache = layer.kv_cache
    kv_h, d = k_cache.shape[-2:]
    k_cache.view(-1, kv_h, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kv_h, d).index_copy_(0, slots, v.to(v_cache.dtype))
