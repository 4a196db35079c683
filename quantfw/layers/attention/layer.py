"""The Attention module every model uses.

* Cache-free: ``attn(q, k, v)`` with q [b, s, heads, d] and k/v [b, s, kv_heads, d] attends
  causally within each row (what ``model(input_ids)`` uses, like transformers).
* Cache-aware: ``attn(q, k, v, meta)`` with flat tokens (q [T, heads, d], k/v [T, kv_heads, d])
  stores k/v in the layer's paged KV cache and attends over each sequence's cached context
  through ``meta.backend`` (see `AttentionMetadata`).

Options every backend honours: ``sliding_window`` (key j is visible to the query at position i
when ``i - window < j <= i``, as transformers' sliding-window masks) and ``sinks`` (one learned
logit per head that joins the softmax denominator only, GPT-OSS's attention sinks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantfw import distributed as qdist
from quantfw.kernels.dense.ops import QkvRopeStore
from quantfw.layers.attention.metadata import AttentionMetadata
from quantfw.layers.rotary import RopeArgs
from quantfw.layers.sharding import load_column_shard, set_weight_attrs


def visible_keys(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean mask [..., Q, K]: causal, and within the window when one is given."""
    q, k = query_pos.unsqueeze(-1), key_pos.unsqueeze(-2)
    allowed = k <= q
    if sliding_window is not None:
        allowed = allowed & (k > q - sliding_window)
    return allowed


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Masked grouped-query SDPA: q [B, H, Q, d], k/v [B, KV, K, d], allowed [B, 1, Q, K] ->
    [B, H, Q, d]. Sinks become one extra key with a zero value whose logit is the sink."""
    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa
        )
    b, h, nq, _ = q.shape
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~allowed, float("-inf")).expand(b, h, nq, -1)
    sink_col = sinks.to(q.dtype).view(1, h, 1, 1).expand(b, h, nq, 1)
    bias = torch.cat((bias, sink_col), dim=-1)
    k = torch.cat((k, k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])), dim=2)
    v = torch.cat((v, v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3])), dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)


class Attention(nn.Module):
    """Grouped-query attention over this rank's heads; cache-free SDPA or cache-aware through
    ``meta.backend``. The engine binds ``kv_cache`` (key and value block tensors) and
    ``kv_group`` (the layer's KV-cache group) before cache-aware steps.

    With ``use_sinks`` the layer owns ``sinks`` [num_heads] (float32, this rank's heads; loaded
    from the full [total heads] tensor like a column-parallel output)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        use_sinks: bool = False,
        prefix: str = "",
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"layer {prefix or '(root)'}: num_heads {num_heads} is not a multiple of "
                f"num_kv_heads {num_kv_heads}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"layer {prefix or '(root)'}: sliding_window={sliding_window} < 1")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.prefix = prefix
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_group = 0
        if use_sinks:
            self.sinks = nn.Parameter(
                torch.empty(num_heads, dtype=torch.float32), requires_grad=False
            )
            tp_rank, tp_size = qdist.get_tp_rank(), qdist.get_tp_size()

            def load_sinks(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
                load_column_shard(param, loaded, tp_rank, tp_size)

            set_weight_attrs(self.sinks, {"output_dim": 0, "weight_loader": load_sinks})
        else:
            self.register_parameter("sinks", None)

    def decode_rope_store(self, meta: AttentionMetadata, rope: RopeArgs) -> QkvRopeStore | None:
        """Where a q/k/v projection that rotates and stores itself puts this step's key and
        value (`QKVParallelLinear.forward_rope_store`), when the step is one decoding token and
        `rope` rotates whole heads with no per-head norm; None otherwise. The attention then
        runs as ``forward(q, None, None, meta)``."""
        cos_sin = rope.cos_sin
        if (
            not meta.is_decode
            or meta.slot_mappings[self.kv_group].numel() != 1
            or rope.q_weight is not None
            or rope.k_weight is not None
            or rope.rotary_dim != self.head_dim
            or cos_sin.dtype != torch.float32
            or not cos_sin.is_contiguous()
            or self.kv_cache is None
        ):
            return None
        k_cache, v_cache = self.kv_cache
        return QkvRopeStore(
            cos_sin.view(-1),
            meta.slot_mappings[self.kv_group],
            k_cache,
            v_cache,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        meta: AttentionMetadata | None = None,
        rope: RopeArgs | None = None,
    ) -> torch.Tensor:
        """`rope`: rotate (and per-head normalize) q and k here, fused with the cache store.
        With `meta`, k and v may be None: this step's keys and values are in the cache already
        (written by the projection, `decode_rope_store`) and q is rotated."""
        if meta is not None:
            if self.kv_cache is None:
                raise RuntimeError(
                    f"layer {self.prefix or '(root)'}: cache-aware attention ran before a KV "
                    "cache was bound"
                )
            return meta.backend.forward(self, q, k, v, meta, rope)
        if k is None or v is None:
            raise ValueError(f"layer {self.prefix or '(root)'}: cache-free attention needs k and v")
        if rope is not None:
            q, k = rope.apply(q, k)
        b, s = q.shape[:2]
        pos = torch.arange(s, device=q.device)
        if self.sliding_window is None and self.sinks is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                scale=self.scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
        else:
            allowed = visible_keys(pos, pos, self.sliding_window).view(1, 1, s, s)
            out = sdpa(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                allowed,
                self.scale,
                self.sinks,
            )
        return out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        extra = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        extra += ", sinks" if self.sinks is not None else ""
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            + extra
        )
