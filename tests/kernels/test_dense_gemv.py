"""The one-token dense GEMV (`kernels.dense`): which shapes it takes, its sm_90 compile, and on
the GPU the kernel against a float32 reference with the same bits on every call (the
interpreter twin is in tests/scripts/triton_interpret_check.py)."""

from __future__ import annotations

import re

import pytest
import torch

from quantfw.kernels.dense import ops


def test_gemv_config_by_weight_size():
    for n, k in ((32, 2880), (5120, 2880), (2880, 4096), (4096, 12288)):  # router, qkv, o, down
        assert ops.gemv_config(n, k)["block_n"] == 4, (n, k)
    for n, k in ((24576, 4096), (201088, 2880), (151936, 4096)):  # gate_up, LM heads
        assert ops.gemv_config(n, k)["block_n"] == 2, (n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_dense_gemv_matches_reference(dtype):
    pytest.importorskip("triton")
    from quantfw.kernels.dense.gemv import dense_gemv

    g = torch.Generator().manual_seed(1)
    for n, k, bias in ((32, 2880, True), (128, 2048, False), (70, 300, True), (65536, 4096, False)):
        w = torch.randn(n, k, generator=g).to(dtype).cuda()
        x = torch.randn(1, k, generator=g).to(dtype).cuda()
        b = torch.randn(n, generator=g).to(dtype).cuda() if bias else None
        ref = x.float() @ w.float().T + (b.float() if bias else 0)
        cfg = ops.gemv_config(n, k)
        for _ in range(2):  # the second call finds the split-K workspace zeroed again
            out = dense_gemv(x, w, b, **cfg)
            assert out.dtype == dtype and out.shape == (1, n)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            assert err <= 4e-3, (n, k, err)
        via = ops.linear(x.view(1, 1, k), w, b)  # what the layers call
        assert via.shape == (1, 1, n)
        if ops.cuda_capability(x.device) in ops.CAPABILITIES:  # the GEMV serves this GPU
            assert torch.equal(via.view(1, n), out)  # an ordered split-K sum: the same bits


@pytest.mark.parametrize("split,pdl", [(1, False), (4, True)])
def test_gemv_and_router_kernels_compile_for_sm90_without_a_gpu(split, pdl):
    """Ahead-of-time compiles through Triton's bundled ptxas (no GPU): the GEMV with and
    without the split-K epilogue (and in the two configs `ops.gemv_config` ships, 16-byte
    aligned), and the one-launch router of `moe.triton_routing`, with and without
    programmatic dependent launch."""
    pytest.importorskip("triton")
    from aot import compile_for_sm90

    from quantfw.kernels.dense.gemv import _dense_gemv_kernel
    from quantfw.kernels.moe.triton_routing import _router_topk_kernel

    signature = {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
        "ws_ptr": "*fp32", "cnt_ptr": "*i32", "N": "i32", "K": "i32", "stride_wn": "i32",
        "k_per_split": "i32", "cs_ptr": "*fp32", "slot_ptr": "*i64", "k_cache": "*bf16",
        "v_cache": "*bf16",
    }  # fmt: skip
    plain = {"ROPE": False, "Q_ROWS": 0, "KV_ROWS": 0, "HEAD_DIM": 0}
    consts = {"BN": 16, "BK": 256, "SPLIT": split, "SPLIT_P": split, "HAS_BIAS": True, "PDL": pdl,
              **plain}  # fmt: skip
    kernel = compile_for_sm90(_dense_gemv_kernel, signature, consts, num_warps=4, launch_pdl=pdl)
    ptx = kernel.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == pdl
    if pdl:  # the first weight step is loaded before the wait, x (the previous kernel's) after
        release, wait = (
            ptx.index("griddepcontrol.launch_dependents"),
            ptx.index("griddepcontrol.wait"),
        )
        weight_load = ptx.index("ld.global.L1::evict_first")
        assert release < weight_load < wait
        plain_load = r"ld\.global(\.v\d)?\.b"  # x's (and the bias's): no cache hint
        assert re.search(plain_load, ptx[:wait]) is None and re.search(plain_load, ptx[wait:])
    assert ("atom.global" in ptx or "red.global" in ptx) == (split > 1)
    # the shipped configs, aligned as the JIT sees them: 16-byte weight loads, the first
    # step's before the wait
    aligned = ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "K", "stride_wn",
               "k_per_split")  # fmt: skip
    # GPT-OSS-20B's q/k/v projection with its rotary epilogue (64 + 2 x 8 heads of 64)
    rope = {"ROPE": True, "Q_ROWS": 64 * 64, "KV_ROWS": 8 * 64, "HEAD_DIM": 64}
    for cfg, extra in ((ops.gemv_config(5120, 2880), plain), (ops.gemv_config(201088, 2880), plain),
                       (ops.gemv_config(5120, 2880), rope)):  # fmt: skip
        consts = {"BN": cfg["block_n"], "BK": cfg["block_k"], "SPLIT": split, "SPLIT_P": split,
                  "HAS_BIAS": True, "PDL": pdl, **extra}  # fmt: skip
        kernel = compile_for_sm90(
            _dense_gemv_kernel, signature, consts, aligned, num_warps=cfg["warps"], launch_pdl=pdl
        )
        ptx = kernel.asm["ptx"]
        vector_loads = re.findall(r"ld\.global\.L1::evict_first\S*\.v4\.b32", ptx)
        assert len(vector_loads) >= 2, cfg  # the first step and the loop's next step
        if pdl:
            assert ptx.index(vector_loads[0]) < ptx.index("griddepcontrol.wait")
    signature = {
        "logits_ptr": "*bf16", "weights_ptr": "*bf16", "ids_ptr": "*i64", "T": "i32", "E": "i32",
        "stride_t": "i32",
    }  # fmt: skip
    for softmax_first in (True, False):
        consts = {"TOP_K": 4, "E_P": 32, "ROWS": 16, "SOFTMAX_FIRST": softmax_first,
                  "RENORM": True, "PDL": pdl}  # fmt: skip
        compile_for_sm90(_router_topk_kernel, signature, consts, num_warps=1, launch_pdl=pdl)


def _rope_case(nh, nkv, d, k, dtype, device, seed=2):
    g = torch.Generator().manual_seed(seed)
    n = (nh + 2 * nkv) * d
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    angles = 37.0 * 10000 ** (-torch.arange(0, d, 2).double() / d)
    cs = torch.cat((angles.cos(), angles.sin())).float().to(device)
    caches = [torch.randn(4, 16, nkv, d, generator=g).to(dtype).to(device) for _ in range(2)]
    slot = torch.tensor([21], device=device)
    return w, x, b, cs, caches, slot


def test_rope_store_check_names_what_does_not_fit():
    w, _, _, cs, (kc, vc), slot = _rope_case(4, 2, 16, 32, torch.float32, "cpu")
    ops.QkvRopeStore(cs, slot, kc, vc, 4, 2, 16).check(w, 4)  # fits
    with pytest.raises(ValueError, match=r"weight \(128, 32\) is not 4 \+ 2 x 1 heads"):
        ops.QkvRopeStore(cs, slot, kc, vc, 4, 1, 16).check(w, 4)
    with pytest.raises(ValueError, match="head_dim 16 and block_n 3"):
        ops.QkvRopeStore(cs, slot, kc, vc, 4, 2, 16).check(w, 3)
    with pytest.raises(ValueError, match="cos_sin .* torch.float16"):
        ops.QkvRopeStore(cs.half(), slot, kc, vc, 4, 2, 16).check(w, 4)
    with pytest.raises(ValueError, match=r"slot \(2,\) torch.int64"):
        ops.QkvRopeStore(cs, slot.repeat(2), kc, vc, 4, 2, 16).check(w, 4)
    assert not ops.QkvRopeStore(cs, slot.int(), kc, vc, 4, 2, 16).problems(w, 4)


def test_layer_path_declines_an_epilogue_that_does_not_fit(monkeypatch):
    """Where the GEMV would serve the call but its epilogue does not fit the shapes (here the
    weight has more rows than the heads), `linear_rope_store` returns None, and the layer
    projects, rotates and stores as usual, instead of raising."""
    w, _, _, cs, (kc, vc), slot = _rope_case(4, 2, 16, 32, torch.float32, "cpu")
    monkeypatch.setattr(ops, "_gemv_serves", lambda *args: True)
    odd = ops.QkvRopeStore(cs, slot, kc, vc, 4, 1, 16)
    assert ops.linear_rope_store(torch.randn(1, 32), w, None, odd) is None
    with pytest.raises(ValueError, match=r"v_cache \(16, 4, 2, 16\) \(contiguous rows of 32\)"):
        ops.QkvRopeStore(cs, slot, kc, vc.transpose(0, 1), 4, 2, 16).check(w, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rope_store_epilogue_writes_what_the_two_kernels_write(dtype):
    """The GEMV with its rotary epilogue against the GEMV and then the rotary-and-store kernel
    (what a decode step ran before): the same bits in q and in both caches, at GPT-OSS-20B's
    and a Llama-shaped q/k/v projection, and one of 8 + 1 heads whose 144 column tiles split
    K."""
    pytest.importorskip("triton")
    from quantfw.kernels.dense.gemv import dense_gemv
    from quantfw.kernels.fused import triton_ops

    for nh, nkv, d, k in ((64, 8, 64, 2880), (32, 8, 128, 4096), (8, 1, 64, 2880)):
        w, x, b, cs, (kc, vc), slot = _rope_case(nh, nkv, d, k, dtype, "cuda")
        k_twin, v_twin = kc.clone(), vc.clone()
        cfg = ops.gemv_config(*w.shape)
        q = dense_gemv(x, w, b, rope_store=ops.QkvRopeStore(cs, slot, kc, vc, nh, nkv, d), **cfg)
        qkv = dense_gemv(x, w, b, **cfg)
        tq, tk, tv = (
            t.reshape(1, -1, d).clone() for t in qkv.split([nh * d, nkv * d, nkv * d], -1)
        )
        flat = (k_twin.view(-1, nkv, d), v_twin.view(-1, nkv, d), slot)
        triton_ops.qk_norm_rope(tq, tk, cs, d, None, None, 0.0, store=(tv, *flat))
        torch.cuda.synchronize()
        assert q.shape == (1, nh * d)
        assert torch.equal(q.view(1, nh, d), tq), (nh, nkv, d)
        assert torch.equal(kc, k_twin) and torch.equal(vc, v_twin), (nh, nkv, d)
        assert not torch.equal(kc.view(-1, nkv, d)[21], tk[0])  # the key was rotated
