"""Programmatic dependent launch (`quantfw.kernels.common.pdl`): when it is on, where the
kernels wait, and that a CUDA graph of dependent kernels launched with it computes what the
same kernels compute one by one without it."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from aot import compile_for_sm90  # noqa: E402

from quantfw.kernels.common import pdl  # noqa: E402


def test_enabled_only_on_cuda_and_can_be_turned_off(monkeypatch):
    cpu = torch.device("cpu")
    assert not pdl.enabled(cpu)
    monkeypatch.setenv("QUANTFW_PDL", "0")
    assert not pdl.enabled(cpu)
    assert pdl.launch_options(False) == {"PDL": False}
    assert pdl.launch_options(True) == {"PDL": True, "launch_pdl": True}
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        hopper = torch.cuda.get_device_capability() >= (9, 0)
        assert not pdl.enabled(dev)  # QUANTFW_PDL=0
        monkeypatch.setenv("QUANTFW_PDL", "1")
        assert pdl.enabled(dev) == hopper
        pdl.set_enabled(False)
        try:
            assert not pdl.enabled(dev)
        finally:
            pdl.set_enabled(None)


def test_elementwise_kernel_waits_before_any_load_for_sm90():
    from quantfw.kernels.fused import triton_ops

    sig = {"x_ptr": "*fp16", "res_ptr": "*fp16", "w_ptr": "*fp16", "out_ptr": "*fp16",
           "res_out_ptr": "*fp16", "n_cols": "i32", "x_stride": "i32", "res_stride": "i32",
           "eps": "fp32"}  # fmt: skip
    consts = {"HAS_RES": True, "WEIGHT_IN_F32": False, "BLOCK": 1024, "PDL": True}
    kernel = compile_for_sm90(
        triton_ops._rms_norm_kernel, sig, consts, num_warps=4, launch_pdl=True
    )
    ptx = kernel.asm["ptx"]
    release, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
    assert release < wait < ptx.index("ld.global")


def test_decode_attention_reads_cached_keys_before_its_wait_for_sm90():
    """The paged decode kernel compiled with PDL: it lets the next kernel launch first, reads
    the context length, the block table and its first tile of cached keys and values before
    its wait (earlier steps wrote them), and q and the new token's key and value after it."""
    from quantfw.kernels.attention import triton_paged

    sig = {"q_ptr": "*fp16", "k_cache": "*fp16", "v_cache": "*fp16", "block_tables": "*i32",
           "context_lens": "*i32", "sinks_ptr": "*fp32", "out_ptr": "*fp16", "part_out": "*fp32",
           "part_lse": "*fp32", "q_stride_t": "i32", "q_stride_h": "i32", "bt_stride": "i32",
           "out_stride_t": "i32", "scale_log2": "fp32", "window": "i32"}  # fmt: skip
    consts = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, GROUP_P=16, HEAD_DIM=128, D_P=128,
                  PAGE=16, BLOCK_N=64, NUM_SPLITS=32, HAS_WINDOW=False, HAS_SINKS=True,
                  PRECISION="tf32", PDL=True)  # fmt: skip
    kernel = compile_for_sm90(
        triton_paged._paged_decode_kernel,
        sig,
        consts,
        num_warps=4,
        num_stages=2,
        launch_pdl=True,
    )
    ptx = kernel.asm["ptx"]
    release, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.wait") == 1 and release < ptx.index("ld.global") < wait
    # the context length, block-table entries, keys and values: more than a few loads
    assert len(re.findall(r"\bld\.global", ptx[:wait])) >= 4
    assert "ld.global" in ptx[wait:]  # q, the new token's row, the later tiles


_W4A16_MMA_SIGNATURE = {
    "x_ptr": "*i32", "qf_ptr": "*i32", "sz_ptr": "*i32", "bias_ptr": "*fp16", "out_ptr": "*fp16",
    "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K2": "i32", "NB": "i32",
    "KB": "i32", "n_iter": "i32", "stride_xm": "i32", "stride_om": "i32",
}  # fmt: skip


@pytest.mark.parametrize("tm,pipe", [(8, True), (16, True), (8, False)])
def test_w4a16_mma_kernel_loads_weights_before_its_wait_for_sm90(tm, pipe):
    """The W4A16 Gluon kernel compiled with PDL (Triton's bundled ptxas, no GPU): it lets the
    next kernel launch before any load and waits once; with PIPE the first chunk's weight and
    scale loads go out before the wait (without, the loop loads every chunk after it)."""
    from quantfw.kernels.w4a16.triton import mma as WM

    consts = dict(W=4, WK=1, CH=4, GKB=8, TM=tm, SPLIT=2, PIPE=pipe, FOLD=False, MASK_N=True,
                  MASK_K=True, HAS_BIAS=True, IS_BF16=False, PDL=True)  # fmt: skip
    kernel = compile_for_sm90(
        WM.w4a16_mma_kernel, _W4A16_MMA_SIGNATURE, consts, num_warps=4, launch_pdl=True
    )
    ptx = kernel.asm["ptx"]
    release = ptx.index("griddepcontrol.launch_dependents")
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.wait") == 1 and release < ptx.index("ld.global")
    before = re.findall(r"\bld\.global", ptx[:wait])
    if pipe:  # a word bundle per k16 step and two scale bundles per group
        assert len(before) >= consts["CH"] + 2
    else:
        assert not before
    assert "ld.global" in ptx[wait:]  # x


def _needs_pdl_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a CUDA GPU of compute capability 9.0+")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16])
def test_graph_of_dependent_kernels_with_pdl_matches_them_without(M):
    """RMSNorm -> kbit K = 4 (mma) -> SiLU-and-mul -> W4A16 (mma) -> RMSNorm + residual ->
    kbit K = 2: each kernel reads what the one before wrote. Captured in a CUDA graph with PDL
    and replayed on fresh inputs, it matches the kernels run one by one without PDL; a kernel
    that read its input before its wait would read the previous replay's values."""
    _needs_pdl_gpu()
    from quantfw.kernels import w4a16 as W
    from quantfw.kernels.fused import triton_ops as F
    from quantfw.kernels.kbit.ops import kbit_matmul
    from quantfw.kernels.kbit.triton.tuning import random_kbit

    H, inter, G, dt = 1024, 2048, 128, torch.float16
    gen = torch.Generator(device="cuda").manual_seed(7)
    w_up = random_kbit(2 * inter, H, 4, "cuda")
    w_out = random_kbit(H, H, 2, "cuda")
    qw = torch.randint(-(2**31), 2**31 - 1, (inter, H // 8), dtype=torch.int32, generator=gen,
                       device="cuda")  # fmt: skip
    qz = torch.randint(-(2**31), 2**31 - 1, (inter // G, H // 8), dtype=torch.int32,
                       generator=gen, device="cuda")  # fmt: skip
    scales = (torch.rand(inter // G, H, generator=gen, device="cuda") * 2e-3 + 1e-3).to(dt)
    w_down = W.repack_awq(qw, qz, scales, G)
    norm_w = (torch.rand(H, generator=gen, device="cuda") + 0.5).to(dt)

    def step(x):
        h = F.rms_norm(x, norm_w, 1e-6)
        a = F.silu_and_mul(kbit_matmul(h, w_up))
        y = W.w4a16_matmul(a, w_down)
        h2, res = F.rms_norm(y, norm_w, 1e-6, residual=x)
        return kbit_matmul(h2, w_out), res

    inputs = [torch.randn(M, H, generator=gen, device="cuda").to(dt) for _ in range(4)]
    pdl.set_enabled(False)
    try:
        want = [step(x) for x in inputs]
    finally:
        pdl.set_enabled(None)
    assert pdl.enabled(torch.device("cuda"))
    static_x = inputs[0].clone()
    step(static_x)  # compile the PDL variants, size the workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(static_x)
    for x, (out_ref, res_ref) in zip(inputs, want):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        out, res = got
        assert torch.isfinite(out).all()
        # split-K sums in the W4A16 GEMM land in any order: equal up to fp16 rounding
        for name, a, b in (("residual", res, res_ref), ("output", out, out_ref)):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert err < 2e-3, f"M={M}: {name} of the PDL graph vs eager without PDL, {err:.2e}"
