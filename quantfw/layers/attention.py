"""Attention: one module, two modes, pluggable backends.

* Cache-free: ``Attention(q, k, v)`` with q [b, s, h, d] and k/v [b, s, kv_h, d] runs causal
  grouped-query SDPA (what ``model(input_ids)`` uses).
* Cache-aware: ``Attention(q, k, v, meta)`` with flattened tokens (q [T, h, d], k/v [T, kv_h, d])
  writes k/v into the layer's KV cache and attends over each sequence's cached context. The
  `AttentionMetadata` of a step says which cache slot and positions every token has; its
  `backend` (`SDPABackend`, or `FlashInferBackend` on CUDA) does the work.

KV cache layout (see docs/engine.md): per layer a key and a value tensor of shape
``[num_slots, max_model_len, kv_heads, head_dim]``; a sequence owns one slot for its lifetime and
its token at position p lives at ``[slot, p]``. FlashInfer reads the same tensors as a paged
cache with one page of ``max_model_len`` tokens per slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Where the tokens of one forward step live. Built once per step, shared by every layer.

    Tensors (on the model device): ``slot_ids`` [B] the cache slot of each sequence;
    ``context_lens`` [B] cached tokens after this step; ``query_start_loc`` [B+1] offsets of each
    sequence's tokens in the flat batch; ``write_index`` [T] flat cache row (slot * max_len + pos)
    of every token; ``query_pos`` [B, max_query_len] the position of each padded query row (0 on
    padding); ``flat_to_padded`` [T] the row of each token in the padded [B * max_query_len] view.
    """

    backend: AttentionBackend
    slot_ids: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    write_index: torch.Tensor
    query_pos: torch.Tensor
    flat_to_padded: torch.Tensor
    max_query_len: int
    max_context_len: int
    #: per-step scratch a backend computes once and shares across layers (masks, plans)
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.slot_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend:
    """How cache-aware attention is computed. `prepare` runs once per step (inside a CUDA graph
    when one is captured), `forward` once per layer."""

    name = "base"

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers (e.g. the attention mask)."""

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError


def write_kv(layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's k/v [T, kv_h, d] at their (slot, position) rows of the layer's cache."""
    k_cache, v_cache = layer.kv_cache
    kv_h, d = k_cache.shape[-2:]
    k_cache.view(-1, kv_h, d).index_copy_(0, meta.write_index, k.to(k_cache.dtype))
    v_cache.view(-1, kv_h, d).index_copy_(0, meta.write_index, v.to(v_cache.dtype))


class SDPABackend(AttentionBackend):
    """torch scaled_dot_product_attention over the cached context (CPU and GPU).

    Queries are scattered into a padded [B, max_q] batch, keys/values read as each slot's first
    `max_context_len` rows, and one boolean mask keeps key j for query i of sequence b when
    ``j < context_lens[b]`` and ``j <= query_pos[b, i]``. Shapes depend only on
    (B, max_query_len, max_context_len), so a decode step is CUDA-graph capturable.
    """

    name = "sdpa"

    def prepare(self, meta: AttentionMetadata) -> None:
        keys = torch.arange(meta.max_context_len, device=meta.slot_ids.device)
        in_context = keys.view(1, 1, -1) < meta.context_lens.view(-1, 1, 1)
        causal = keys.view(1, 1, -1) <= meta.query_pos.unsqueeze(-1)
        meta.scratch["sdpa_mask"] = (in_context & causal).unsqueeze(1)  # [B, 1, max_q, max_kv]

    def forward(self, layer, q, k, v, meta):
        write_kv(layer, k, v, meta)
        if "sdpa_mask" not in meta.scratch:
            self.prepare(meta)
        k_cache, v_cache = layer.kv_cache
        b, mq, h, d = meta.num_seqs, meta.max_query_len, layer.num_heads, layer.head_dim
        keys = k_cache[meta.slot_ids, : meta.max_context_len].to(q.dtype)
        values = v_cache[meta.slot_ids, : meta.max_context_len].to(q.dtype)
        if mq == 1:
            qp = q.view(b, 1, h, d)
        else:
            qp = q.new_zeros(b * mq, h, d).index_copy_(0, meta.flat_to_padded, q)
            qp = qp.view(b, mq, h, d)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.scratch["sdpa_mask"],
            scale=layer.scale,
            enable_gqa=layer.num_kv_heads != layer.num_heads,
        )
        out = out.transpose(1, 2).reshape(b * mq, h * d)
        return out if mq == 1 else out.index_select(0, meta.flat_to_padded)


class FlashInferBackend(AttentionBackend):
    """FlashInfer's paged prefill/decode wrappers (CUDA, ``pip install flashinfer-python``).

    The per-slot cache is viewed as a paged cache with page size ``max_model_len``: sequence b
    owns page ``slot_ids[b]`` and its last page holds ``context_lens[b]`` tokens. Plans are made
    once per step in `prepare` (outside CUDA graphs: graphs use `SDPABackend` for decode).
    """

    name = "flashinfer"

    def __init__(self, device: torch.device, workspace_bytes: int = 128 * 1024 * 1024):
        import flashinfer  # noqa: F401  (fail early with ImportError when missing)

        self._flashinfer = flashinfer
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.layer_shape: tuple[int, int, int, int, torch.dtype] | None = None

    def configure(
        self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
    ) -> None:
        """Shapes the plans need (the engine calls this once the cache exists)."""
        self.layer_shape = (num_heads, num_kv_heads, head_dim, page_size, dtype)

    def prepare(self, meta: AttentionMetadata) -> None:
        if self.layer_shape is None:
            raise RuntimeError("FlashInferBackend.configure() was not called before a step")
        num_heads, num_kv_heads, head_dim, page_size, dtype = self.layer_shape
        b = meta.num_seqs
        device = meta.slot_ids.device
        kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=device)
        kv_indices = meta.slot_ids.to(torch.int32)
        last_page_len = meta.context_lens.to(torch.int32)
        if meta.is_decode:
            self._decode.plan(
                kv_indptr,
                kv_indices,
                last_page_len,
                num_heads,
                num_kv_heads,
                head_dim,
                page_size,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
        else:
            self._prefill.plan(
                meta.query_start_loc.to(torch.int32),
                kv_indptr,
                kv_indices,
                last_page_len,
                num_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal=True,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
        meta.scratch["flashinfer_planned"] = True

    def forward(self, layer, q, k, v, meta):
        write_kv(layer, k, v, meta)
        if "flashinfer_planned" not in meta.scratch:
            self.prepare(meta)
        wrapper = self._decode if meta.is_decode else self._prefill
        out = wrapper.run(q.contiguous(), layer.kv_cache)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)


class Attention(nn.Module):
    """Grouped-query attention; cache-free causal SDPA, or cache-aware through `meta.backend`.

    The engine binds ``kv_cache`` (a key and a value tensor) to every layer before running
    cache-aware steps.
    """

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
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        if meta is not None:
            if self.kv_cache is None:
                raise RuntimeError("cache-aware attention ran before a KV cache was bound")
            return meta.backend.forward(self, q, k, v, meta)
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


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """``"auto"`` (FlashInfer on CUDA for fp16/bf16 caches when installed, else SDPA),
    ``"sdpa"`` or ``"flashinfer"``."""
    if name == "auto":
        usable = device.type == "cuda" and dtype in FLASHINFER_DTYPES
        name = "flashinfer" if usable and flashinfer_available() else "sdpa"
    if name == "sdpa":
        return SDPABackend()
    if name == "flashinfer":
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(
                f"attention_backend='flashinfer' needs a float16 or bfloat16 model, got {dtype}; "
                "use attention_backend='sdpa'"
            )
        if device.type != "cuda":
            raise ValueError("attention_backend='flashinfer' needs a CUDA device")
        return FlashInferBackend(device)
    raise ValueError(f"unknown attention_backend {name!r}; supported: auto, sdpa, flashinfer")
