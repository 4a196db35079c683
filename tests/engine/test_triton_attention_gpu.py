"""Our Triton paged-attention kernels on the GPU equal dense float64 attention (fp32) and stay
within rounding in fp16/bf16, at the shapes models use (head_dim 64/128, GQA 4-8, blocks of 16,
contexts up to a few thousand tokens with split-K decode), sliding windows and sinks included."""

from __future__ import annotations

import pytest
import torch
from paged_case import make_case

CASES = {
    "decode_long": dict(cached=[0, 31, 700, 2500], new=[1, 1, 1, 1]),
    "prefill": dict(cached=[0, 0], new=[300, 77]),
    "chunked_mixed": dict(cached=[500, 16, 0], new=[130, 1, 65]),
}
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window,sinks", [(None, False), (128, True)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (8, 1, 64)])
def test_triton_backend_matches_reference(dtype, case, window, sinks, heads, kv_heads, head_dim):
    from quantfw.layers.attention.backends.triton import TritonBackend

    c = make_case(
        **CASES[case], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
        window=window, sinks=sinks, dtype=dtype, device="cuda",
    )  # fmt: skip
    backend = TritonBackend()
    meta = c.metadata(backend)
    out = torch.full((sum(c.new), heads * head_dim), float("nan"), dtype=dtype, device="cuda")
    out.copy_(backend.forward(c.layer, c.q, c.k, c.v, meta))
    ref = c.reference()
    assert torch.isfinite(out).all()
    err = ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_ops_match_reference_on_gpu(dtype):
    from quantfw.kernels.fused import reference, triton_ops

    torch.manual_seed(0)
    x = torch.randn(37, 4096, dtype=dtype, device="cuda")
    r, w = torch.randn_like(x), torch.randn(4096, dtype=dtype, device="cuda")
    # the same roundings as torch; fp32 sums in another order may move a value by one ulp
    ulp = torch.finfo(dtype).eps

    def close(a, b):
        return torch.allclose(a.float(), b.float(), rtol=2 * ulp, atol=2 * ulp)

    for f32 in (False, True):
        kw = dict(weight_in_float32=f32)
        assert close(triton_ops.rms_norm(x, w, 1e-6, **kw), reference.rms_norm(x, w, 1e-6, **kw))
        (a, ar) = triton_ops.rms_norm(x, w, 1e-6, r, **kw)
        (b, br) = reference.rms_norm(x, w, 1e-6, r, **kw)
        assert torch.equal(ar, br) and close(a, b)
    y = torch.randn(37, 2 * 12288, dtype=dtype, device="cuda")
    assert close(triton_ops.silu_and_mul(y), reference.silu_and_mul(y))
    qkv = torch.randn(37, 48 * 128, dtype=dtype, device="cuda")
    q, k = qkv[:, : 32 * 128].view(37, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(37, 8, 128)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    f = torch.randint(0, 40000, (37,), device="cuda").float()[:, None] * inv
    cs = torch.cat((f.cos(), f.sin()), -1)
    qw, kw = (
        torch.randn(128, dtype=dtype, device="cuda"),
        torch.randn(128, dtype=dtype, device="cuda"),
    )
    rq, rk = reference.qk_norm_rope(q.clone(), k.clone(), cs, 128, qw, kw, 1e-6)
    tq, tk = triton_ops.qk_norm_rope(q, k, cs, 128, qw, kw, 1e-6)
    for ours, ref in ((tq, rq), (tk, rk)):  # rotary rounds once instead of three times
        err = ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
        assert err <= (4e-3 if dtype == torch.float16 else 3e-2), err


@pytest.mark.gpu
def test_decode_reads_the_new_key_after_its_wait_under_pdl():
    """A CUDA graph with programmatic dependent launch: a long kernel, the store of the new
    tokens' keys and values, the decode kernel. The decode kernel launches while the store
    waits, and reads the keys and values that earlier steps cached before its own wait; each
    replay with fresh new keys, values and queries matches the reference (the new token's slot
    read early would hold the previous replay's)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a CUDA GPU of compute capability 9.0+ (PDL)")
    from quantfw.kernels.attention import triton_paged
    from quantfw.kernels.common import pdl
    from quantfw.kernels.fused import triton_ops
    from quantfw.layers.attention.backends.triton import TritonBackend

    assert pdl.enabled(torch.device("cuda"))
    dt = torch.float16
    c = make_case(cached=[0, 40, 100, 700], new=[1, 1, 1, 1], heads=32, kv_heads=8,
                  head_dim=128, block_size=16, sinks=True, dtype=dt, device="cuda")  # fmt: skip
    meta = c.metadata(TritonBackend())
    k_cache, v_cache = c.layer.kv_cache
    big = torch.randn(16384, 8192, dtype=dt, device="cuda")  # about 0.3 ms of RMSNorm
    norm_w = torch.randn(8192, dtype=dt, device="cuda")

    def step():
        triton_ops.rms_norm(big, norm_w, 1e-6)
        triton_paged.store_kv(c.k, c.v, k_cache, v_cache, meta.slot_mappings[0])
        return triton_paged.paged_decode(
            c.q, k_cache, v_cache, meta.block_tables[0], meta.context_lens, c.layer.scale,
            num_splits=32, sinks=c.layer.sinks,
        )  # fmt: skip

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(4):
        for buf in (c.q, c.k, c.v):
            buf.copy_(torch.randn_like(buf))
        for b in range(len(c.new)):  # the new token is each context's last position
            c.keys[b][-1] = c.k[b].cpu()
            c.values[b][-1] = c.v[b].cpu()
        graph.replay()
        ref = c.reference()
        err = ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()
        assert err <= TOL[dt], err
