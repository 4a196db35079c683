"""Our Triton kernels over the paged cache (CUDA): a split-K decode kernel (CUDA-graph
capturable) and a causal prefill kernel for prefill, chunked prefill and mixed batches
(`quantfw.kernels.attention.triton_paged`)."""

from __future__ import annotations

from quantfw.layers.attention.backends.base import AttentionBackend, write_kv


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_capturable = True
    prefill_graph_capturable = True

    def __init__(self) -> None:
        from quantfw.kernels.attention import triton_paged

        self._kernels = triton_paged

    def forward(self, layer, q, k, v, meta, rope=None):
        kern = self._kernels
        k_cache, v_cache = layer.kv_cache
        group = layer.kv_group
        q = write_kv(layer, q, k, v, meta, rope)
        if meta.is_decode:
            splits = meta.scratch.get("decode_splits")
            if splits is None:
                splits = kern.decode_splits(meta.num_seqs, layer.num_kv_heads, meta.max_context_len)
                meta.scratch["decode_splits"] = splits
            return kern.paged_decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables[group],
                meta.context_lens,
                layer.scale,
                num_splits=splits,
                sliding_window=layer.sliding_window,
                sinks=layer.sinks,
            )
        return kern.paged_prefill(
            q,
            k_cache,
            v_cache,
            meta.block_tables[group],
            meta.query_start_loc,
            meta.context_lens,
            meta.max_query_len,
            layer.scale,
            sliding_window=layer.sliding_window,
            sinks=layer.sinks,
        )
