"""The interface every attention backend implements."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantfw.kernels import fused
from quantfw.layers.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from quantfw.layers.attention.layer import Attention
    from quantfw.layers.rotary import RopeArgs


class AttentionBackend:
    """Cache-aware attention. `prepare` runs once per step (inside a CUDA graph when one is
    captured, so it must not sync with the host), `forward` once per layer: it stores the new
    keys/values at the step's slot mapping and attends over each sequence's cached context,
    honouring the layer's `sliding_window` and `sinks`.

    ``forward(layer, q [T, heads, head_dim], k/v [T, kv_heads, head_dim], meta, rope)`` returns
    ``[T, heads * head_dim]`` in q's dtype. With `rope`, q and k arrive unrotated and the backend
    rotates them (`write_kv` fuses that with storing the keys). k and v None: this step's keys
    and values are in the cache already (`Attention.decode_rope_store`).
    """

    name = "base"
    #: whether `forward` may run inside a captured CUDA graph (fixed shapes, no host syncs):
    #: decode steps, and with `prefill_graph_capturable` steps of several tokens a sequence too
    graph_capturable = False
    prefill_graph_capturable = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers."""

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        meta: AttentionMetadata,
        rope: RopeArgs | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError


def write_kv(
    layer: Attention,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    meta: AttentionMetadata,
    rope: RopeArgs | None,
) -> torch.Tensor:
    """Store this step's k/v [T, kv_heads, head_dim] at their slots (rotating k first when
    `rope` is given: one fused kernel on CUDA); returns q, rotated when `rope` is given. k and v
    None: they are stored already (`Attention.decode_rope_store`), q is returned as it is."""
    if k is None or v is None:
        where = f"layer {layer.prefix or '(root)'}"
        if k is not None or v is not None:
            raise ValueError(f"{where}: pass both k and v, or neither (stored already)")
        if rope is not None:
            raise ValueError(f"{where}: stored keys come rotated already")
        return q
    k_cache, v_cache = layer.kv_cache
    slots = meta.slot_mappings[layer.kv_group]
    if rope is not None:
        q, _ = rope.apply(q, k, store=(v, k_cache, v_cache, slots))
        return q
    fused.store_kv(k, v, k_cache, v_cache, slots)
    return q
