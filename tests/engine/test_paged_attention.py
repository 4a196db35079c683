"""The SDPA backend over the paged cache equals dense float64 attention (fp32, <= 1e-5 relative):
ragged batches, decode, prefill, chunked prefill (cached prefix + new tokens), block boundaries,
sliding windows and attention sinks; and it stores every new key/value at its slot."""

from __future__ import annotations

import pytest
import torch
from paged_case import make_case

from quantfw.layers.attention import Attention, SDPABackend
from quantfw.layers.attention.layer import sdpa, visible_keys

CASES = {
    "decode_ragged": dict(cached=[0, 7, 16, 3], new=[1, 1, 1, 1]),
    "prefill_ragged": dict(cached=[0, 0, 0], new=[9, 4, 1]),
    "chunked_mixed": dict(cached=[8, 3, 0, 12], new=[5, 1, 7, 4]),
}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window,sinks", [(None, False), (5, False), (None, True), (6, True)])
def test_sdpa_backend_matches_dense_reference(case, window, sinks):
    c = make_case(**CASES[case], window=window, sinks=sinks, block_size=4)
    backend = SDPABackend()
    meta = c.metadata(backend)
    backend.prepare(meta)
    out = backend.forward(c.layer, c.q, c.k, c.v, meta)
    assert out.shape == (sum(c.new), c.layer.num_heads * c.layer.head_dim)
    assert relative_error(out, c.reference()) <= 1e-5
    k_cache, v_cache = c.layer.kv_cache
    rows = k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mappings[0]]
    assert torch.equal(rows, c.k) and torch.equal(
        v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mappings[0]], c.v
    )


@pytest.mark.parametrize("window,sinks", [(3, False), (None, True), (4, True)])
def test_cache_free_attention_window_and_sinks(window, sinks):
    torch.manual_seed(0)
    layer = Attention(4, 8, 2, 8**-0.5, sliding_window=window, use_sinks=sinks)
    if sinks:
        layer.sinks.data.normal_()
    q, k, v = torch.randn(2, 11, 4, 8), torch.randn(2, 11, 2, 8), torch.randn(2, 11, 2, 8)
    out = layer(q, k, v).view(2, 11, 4, 8)
    for b in range(2):
        c = make_case(cached=[0], new=[11], window=window, sinks=sinks, head_dim=8)
        c.layer.sinks = layer.sinks
        c.q, c.keys, c.values = q[b], [k[b]], [v[b]]
        assert relative_error(out[b].reshape(11, -1), c.reference()) <= 1e-5


def test_sdpa_helper_sink_is_only_in_the_denominator():
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    allowed = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    very_negative = torch.full((2,), -1e4)
    plain = sdpa(q, k, v, allowed, 0.5, None)
    assert torch.allclose(sdpa(q, k, v, allowed, 0.5, very_negative), plain, atol=1e-6)
    huge = torch.full((2,), 1e4)  # the sink takes all the probability mass: output -> 0
    assert sdpa(q, k, v, allowed, 0.5, huge).abs().max() < 1e-6
    mask = visible_keys(torch.arange(5), torch.arange(5), 2)
    assert mask.int().tolist()[4] == [0, 0, 0, 1, 1]
