"""When a decode step's q/k/v projection may rotate q and k and store k and v itself
(`Attention.decode_rope_store`), and that attention then reads them as stored (CPU; the GPU
epilogue is checked in tests/kernels/test_dense_gemv.py and the engine tests)."""

from __future__ import annotations

import pytest
import torch

from quantfw.layers.attention import Attention, AttentionMetadata
from quantfw.layers.attention.backends.sdpa import SDPABackend
from quantfw.layers.rotary import RopeArgs


def _layer() -> Attention:
    layer = Attention(4, 16, 2, scale=0.25, prefix="model.layers.0.self_attn.attn")
    layer.kv_cache = (torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16))
    return layer


def _meta(tokens: int) -> AttentionMetadata:
    return AttentionMetadata(
        backend=SDPABackend(),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        context_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=[torch.tensor([[1, 2]], dtype=torch.int32)],
        slot_mappings=[torch.arange(8 - tokens, 8)],
        block_size=4,
        max_query_len=tokens,
        max_context_len=5,
    )


def test_one_decoding_token_with_whole_head_rotary_gets_a_store():
    layer = _layer()
    cos_sin = torch.rand(1, 16)
    store = layer.decode_rope_store(_meta(1), RopeArgs(cos_sin, 16))
    assert store is not None
    assert (store.num_heads, store.num_kv_heads, store.head_dim) == (4, 2, 16)
    assert store.k_cache is layer.kv_cache[0] and store.v_cache is layer.kv_cache[1]
    assert store.slot.tolist() == [7] and store.cos_sin.shape == (16,)


def test_no_store_for_two_decoding_sequences_or_an_unbound_cache():
    meta = _meta(1)
    meta.slot_mappings = [torch.tensor([3, 7])]  # two sequences, one token each
    assert meta.is_decode
    assert _layer().decode_rope_store(meta, RopeArgs(torch.rand(2, 16), 16)) is None
    unbound = _layer()
    unbound.kv_cache = None
    assert unbound.decode_rope_store(_meta(1), RopeArgs(torch.rand(1, 16), 16)) is None


@pytest.mark.parametrize(
    "why, tokens, rope",
    [
        ("a prefill chunk", 3, RopeArgs(torch.rand(3, 16), 16)),
        ("a k norm alone", 1, RopeArgs(torch.rand(1, 16), 16, None, torch.ones(16), 1e-6)),
        ("a strided cos/sin row", 1, RopeArgs(torch.rand(1, 32)[:, ::2], 16)),
        (
            "Qwen3's per-head norm",
            1,
            RopeArgs(torch.rand(1, 16), 16, torch.ones(16), torch.ones(16), 1e-6),
        ),
        ("partial rotary", 1, RopeArgs(torch.rand(1, 8), 8)),
        ("a half-precision table", 1, RopeArgs(torch.rand(1, 16).half(), 16)),
    ],
)
def test_no_store_where_the_epilogue_would_differ(why, tokens, rope):
    assert _layer().decode_rope_store(_meta(tokens), rope) is None, why


def test_stored_keys_are_read_as_they_are():
    """k and v None: the backend stores nothing and attends over the cache with q as given."""
    layer = _layer()
    k_cache, v_cache = layer.kv_cache
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    flat_k[4:9], flat_v[4:9] = keys, values  # blocks 1 and 2 hold positions 0..4
    q = torch.randn(1, 4, 16, generator=g)
    meta = _meta(1)
    meta.slot_mappings = [torch.tensor([8])]
    out = layer(q, None, None, meta)
    kr, vr = keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1)  # [5, 4, 16]
    weights = torch.softmax(torch.einsum("hd,thd->ht", q[0], kr) * 0.25, dim=-1)
    want = torch.einsum("ht,thd->hd", weights, vr).reshape(1, 64)
    assert torch.allclose(out, want, atol=1e-5)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.attn: stored keys"):
        layer(q, None, None, meta, RopeArgs(torch.rand(1, 16), 16))
    with pytest.raises(ValueError, match="pass both k and v, or neither"):
        layer(q, keys[:1], None, meta)
    with pytest.raises(ValueError, match="cache-free attention needs k and v"):
        layer(q.unsqueeze(0), None, None)
