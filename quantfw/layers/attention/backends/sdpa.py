"""The reference backend: gather each sequence's pages and run torch SDPA (CPU and GPU).

Queries are scattered into a padded [B, max_query_len] batch; keys/values are read through the
block tables as each sequence's first `max_context_len` cache rows; one mask per sliding-window
value keeps key j for query i of sequence b when ``j < context_lens[b]`` and j is causally (and
window-) visible from i's position. Shapes depend only on (B, max_query_len, max_context_len).
"""

from __future__ import annotations

import torch

from quantfw.layers.attention.backends.base import AttentionBackend, write_kv
from quantfw.layers.attention.layer import sdpa, visible_keys
from quantfw.layers.attention.metadata import AttentionMetadata


class SDPABackend(AttentionBackend):
    name = "sdpa"
    graph_capturable = True

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.context_lens.device
        b, mq = meta.num_seqs, meta.max_query_len
        ctx = meta.context_lens.long()
        qlen = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
        rows = torch.arange(mq, device=device)
        meta.scratch["sdpa_query_pos"] = (ctx - qlen).unsqueeze(1) + rows  # [B, mq]
        keys = torch.arange(meta.max_context_len, device=device)
        meta.scratch["sdpa_key_pos"] = keys
        meta.scratch["sdpa_in_context"] = (keys.view(1, -1) < ctx.view(-1, 1)).view(b, 1, 1, -1)
        if mq > 1:
            seq_of = torch.repeat_interleave(
                torch.arange(b, device=device), qlen, output_size=int(meta.query_start_loc[-1])
            )
            flat = torch.arange(seq_of.shape[0], device=device)
            meta.scratch["sdpa_flat_to_padded"] = (
                seq_of * mq + flat - meta.query_start_loc.long()[seq_of]
            )

    def _mask(self, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
        key = f"sdpa_mask_{window}"
        if key not in meta.scratch:
            qpos, kpos = meta.scratch["sdpa_query_pos"], meta.scratch["sdpa_key_pos"]
            allowed = visible_keys(qpos, kpos, window).unsqueeze(1)  # [B, 1, mq, L]
            meta.scratch[key] = allowed & meta.scratch["sdpa_in_context"]
        return meta.scratch[key]

    def forward(self, layer, q, k, v, meta, rope=None):
        if "sdpa_query_pos" not in meta.scratch:
            self.prepare(meta)
        q = write_kv(layer, q, k, v, meta, rope)
        k_cache, v_cache = layer.kv_cache
        b, mq, h, d = meta.num_seqs, meta.max_query_len, layer.num_heads, layer.head_dim
        length = meta.max_context_len
        pages = -(-length // meta.block_size)
        table = meta.block_tables[layer.kv_group][:, :pages].reshape(-1).long()
        shape = (b, pages * meta.block_size, layer.num_kv_heads, d)
        # index_select: multi-dimensional advanced indexing is ~500x slower on the CPU
        keys = k_cache.index_select(0, table).view(shape)[:, :length].to(q.dtype)
        values = v_cache.index_select(0, table).view(shape)[:, :length].to(q.dtype)
        if mq == 1:
            qp = q.reshape(b, 1, h, d)
        else:
            index = meta.scratch["sdpa_flat_to_padded"]
            qp = q.new_zeros(b * mq, h, d).index_copy_(0, index, q).view(b, mq, h, d)
        out = sdpa(
            qp.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            self._mask(meta, layer.sliding_window),
            layer.scale,
            layer.sinks,
        )
        out = out.transpose(1, 2).reshape(b * mq, h * d)
        return out if mq == 1 else out.index_select(0, meta.scratch["sdpa_flat_to_padded"])
