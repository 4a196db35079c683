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
        "k_per_split": "i32",
    }  # fmt: skip
    consts = {"BN": 16, "BK": 256, "SPLIT": split, "SPLIT_P": split, "HAS_BIAS": True, "PDL": pdl}
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
    for cfg in (ops.gemv_config(5120, 2880), ops.gemv_config(201088, 2880)):
        consts = {"BN": cfg["block_n"], "BK": cfg["block_k"], "SPLIT": split, "SPLIT_P": split,
                  "HAS_BIAS": True, "PDL": pdl}  # fmt: skip
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
