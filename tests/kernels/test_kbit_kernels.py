"""The kbit tiled layout and the CPU path (CI), the Triton kernels in Triton's CPU interpreter
(skipped without triton), and the same kernels on a GPU (marked ``gpu``) against the reference
(`quantfw.kernels.kbit.format`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from quantfw.kernels import kbit
from quantfw.kernels.kbit import configs as C
from quantfw.kernels.kbit import format as kfmt
from quantfw.kernels.kbit import layout
from quantfw.kernels.kbit import tables as T

INTERPRET_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "kbit_interpret.py")


def random_weight(N: int, K: int, bits: int, seed: int, device="cpu"):
    """(flat planes, absmax, codebook, dense reference [N, K] fp32) of a random N(0, 0.05) weight."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.05
    planes, absmax = kfmt.quantize(w, bits)
    cb = kfmt.normal_float_codebook(bits)
    ref = kfmt.dequantize(planes, absmax, cb)
    return planes.to(device), absmax.to(device), cb.to(device), ref.to(device)


@pytest.mark.parametrize("bits,N,K", [(2, 200, 320), (3, 128, 64), (5, 72, 96)])
def test_tiled_layout_matches_its_definition(bits, N, K):
    planes, absmax, cb, ref = random_weight(N, K, bits, seed=bits)
    w = layout.repack(planes, absmax, cb)
    KT, NT = -(-K // 64), -(-N // 128)
    assert w.qweight.shape == (KT, NT, 128, 2, bits) and w.scales.shape == (KT, NT, 128, 2)
    for kt, nt, c, j in [(0, 0, 0, 0), (KT - 1, NT - 1, 5, 1), (KT // 2, 0, 77, 1)]:
        n, kb = nt * 128 + c, kt * 2 + j
        if n < N and kb < K // 32:
            assert w.qweight[kt, nt, c, j].tolist() == planes[n, kb].tolist()
            assert w.scales[kt, nt, c, j].item() == absmax[n, kb].item()
        else:
            assert not w.qweight[kt, nt, c, j].any() and w.scales[kt, nt, c, j].item() == 0
    flat = w.qweight.permute(1, 2, 0, 3, 4).reshape(NT * 128, KT * 2, bits)
    assert not flat[N:].any() and not flat[:, K // 32 :].any()  # padding: zero blocks
    p2, a2 = layout.unpack(w)
    assert torch.equal(p2, planes) and torch.equal(a2, absmax)
    assert torch.equal(layout.dequantize_weight(w), ref)
    held = sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.codebook))
    assert layout.tiled_nbytes(N, K, bits) == held


def test_cpu_matmul_matches_reference():
    planes, absmax, cb, ref = random_weight(200, 320, 4, seed=1)
    w = kbit.repack_weight(planes, absmax, cb)
    gen = torch.Generator().manual_seed(2)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(2, 3, 320, generator=gen).to(dtype)
        bias = torch.randn(200, generator=gen).to(dtype)
        out = kbit.kbit_matmul(x, w, bias)
        want = x.double() @ ref.double().t() + bias.double()
        assert out.shape == (2, 3, 200) and out.dtype == dtype
        assert ((out.double() - want).norm() / want.norm()).item() < tol
    with pytest.raises(ValueError, match="x has 64 input features, weight has 320"):
        kbit.kbit_matmul(torch.randn(2, 64), w)
    assert "quantfw.kernels.kbit.triton.dispatch" not in sys.modules


def test_configs_and_their_checks():
    for M in (1, 16, 17, 64, 65, 511, 512, 4096):
        for cfg in [*C.candidate_configs(M), C.default_config(M, 4096, 4096, 4)]:
            assert C.check_config(cfg) == cfg
    # the fused kernel only where it was right on the GPU (C.FUSED_MAX_M)
    assert [C.default_config(M, 64, 64, 4)[0] for M in (1, 2, 16, 64, 128, 4096)] == (
        ["fused"] + ["deq"] * 5
    )
    assert all(cfg[0] == "deq" for cfg in C.candidate_configs(2))
    with pytest.raises(ValueError, match=r"here: unknown kernel kind 'mma'; kinds: fused, deq"):
        C.check_config(("mma", 1), "here")
    with pytest.raises(ValueError, match="block_n=256 must be 16, 32, 64 or 128"):
        C.check_config(("fused", 16, 256, 64, 4, 2, 4))
    with pytest.raises(ValueError, match="block_k=96 must be 64, 128, 256"):
        C.check_config(("deq", 64, 96, 4))
    with pytest.raises(ValueError, match="block_m=8 must be 16, 32, 64"):
        C.check_config(("fused", 8, 64, 64, 4, 2, 4))
    with pytest.raises(
        ValueError, match=r"has 2 fields, deq takes \('deq', block_n, block_k, warps\)"
    ):
        C.check_config(("deq", 64, 64))


def test_tables_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(T.ENV_DIR, str(tmp_path))
    T.TABLES.cache_clear()
    small, big = ("fused", 16, 32, 128, 4, 2, 8), ("deq", 128, 128, 8)
    path = tmp_path / T.TABLES.file_name("Fake GPU")
    assert path.name == "kbit-Fake_GPU.json"
    T.TABLES.write_table(path, "Fake GPU", {(640, 256, 3): {1: small, 1024: big}}, "test")
    assert list(json.loads(path.read_text())["shapes"]) == ["N=640,K=256,bits=3"]
    assert T.untuned_config("Fake GPU", 2, 640, 256, 3) == big  # bucket 2 -> tuned M 1024
    assert T.untuned_config("Fake GPU", 1, 640, 256, 3) == small
    assert T.untuned_config("Fake GPU", 1, 640, 256, 4) == C.default_config(1, 640, 256, 4)
    path.write_text('{"shapes": {"N=1,K=2,G=3": {"1": ["deq", 128, 128, 8]}}}')
    T.TABLES.cache_clear()
    with pytest.raises(
        ValueError, match=r"shape key 'N=1,K=2,G=3' is not of the form 'N=<N>,K=<K>,bits=<bits>'"
    ):
        T.TABLES.load_table(path)
    T.TABLES.cache_clear()


def test_triton_kernels_in_the_interpreter():
    """Repack and dequantize bit-exact, the fused GEMM (split-K 1 and > 1, 16- and 32-token
    tiles) and the deq path within fp16 rounding, workspace left clean; K = 2..5, padded N/K."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, INTERPRET_SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )


_GEMM_SIGNATURE = {
    "x_ptr": "*fp16", "qweight_ptr": "*i32", "scales_ptr": "*u8", "codebook_ptr": "*fp32",
    "out_ptr": "*fp16", "bias_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32",
    "N": "i32", "K": "i32", "KT": "i32", "NT": "i32", "stride_xm": "i32", "stride_om": "i32",
    "ITERS": "i32", "SPLIT": "i32", "BITS": "constexpr", "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "HAS_BIAS": "constexpr",
}  # fmt: skip
_DEQUANT_SIGNATURE = {
    "qweight_ptr": "*i32", "scales_ptr": "*u8", "codebook_ptr": "*fp32", "w_ptr": "*bf16",
    "N": "i32", "K": "i32", "KT": "i32", "NT": "i32", "BITS": "constexpr",
    "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
}  # fmt: skip
_REPACK_SIGNATURE = {
    "planes_ptr": "*i32", "absmax_ptr": "*u8", "qweight_ptr": "*i32", "scales_ptr": "*u8",
    "N": "i32", "KB": "i32", "NT": "i32", "BITS": "constexpr",
}  # fmt: skip


def test_kernels_compile_for_sm90_without_a_gpu():
    """Ahead-of-time compiles (Triton's bundled ptxas, no GPU): what the interpreter does not
    check (constexpr rules, layouts, the select tree and the gather paths, shared memory)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantfw.kernels.kbit.triton import kernels as KK

    def compile_(fn, signature, constexprs, warps=4, stages=2):
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        options = {"num_warps": warps, "num_stages": stages}
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

    for bits, tile in ((3, (16, 64, 128)), (4, (64, 128, 64))):
        bm, bn, bk = tile
        consts = {"BITS": bits, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "HAS_BIAS": True}
        kernel = compile_(KK.kbit_gemm_kernel, _GEMM_SIGNATURE, consts)
        assert kernel.metadata.shared <= 228 * 1024
    compile_(KK.kbit_dequant_kernel, _DEQUANT_SIGNATURE, {"BITS": 5, "BLOCK_N": 64, "BLOCK_K": 128})
    compile_(KK.kbit_repack_kernel, _REPACK_SIGNATURE, {"BITS": 3})


# ---------------------------------------------------------------------------------------------
# GPU

gpu = pytest.mark.gpu
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(out, want):
    return ((out.double() - want).norm() / want.norm()).item()


@gpu
@pytest.mark.parametrize("bits", kfmt.SUPPORTED_BITS)
def test_gpu_repack_matches_reference(bits):
    planes, absmax, cb, _ = random_weight(392, 4160, bits, seed=bits, device="cuda")
    got = kbit.repack_weight(planes, absmax, cb)
    want = layout.repack(planes, absmax, cb)
    assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)


@gpu
@pytest.mark.parametrize(
    "bits,N,K,dtype",
    [
        (2, 392, 4160, torch.float16),
        (3, 1024, 512, torch.float16),
        (4, 256, 1056, torch.float16),
        (4, 256, 1056, torch.bfloat16),
        (5, 640, 320, torch.float16),
    ],
)
def test_gpu_configs_match_reference(bits, N, K, dtype):
    """The default config and two tuning candidates per M (fused with split-K 1 and > 1, deq),
    padded N and K, bias; the split-K workspace is left clean."""
    from quantfw.kernels.common import splitk
    from quantfw.kernels.kbit.triton.dispatch import kbit_matmul_cuda

    planes, absmax, cb, ref = random_weight(N, K, bits, seed=N + K, device="cuda")
    w = kbit.repack_weight(planes, absmax, cb)
    gen = torch.Generator(device="cuda").manual_seed(bits)
    for M in (1, 7, 33, 300):
        x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
        bias = torch.randn(N, device="cuda", generator=gen).to(dtype)
        want = x.double() @ ref.double().t() + bias.double()
        configs = {C.default_config(M, N, K, bits), *C.candidate_configs(M)[:2]}
        for cfg in sorted(configs):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            out.copy_(kbit_matmul_cuda(x, w, bias, config=cfg))
            err = _rel(out, want)
            assert err < TOL[dtype], f"bits={bits} N={N} K={K} M={M} {dtype} {cfg}: {err:.2e}"
            ws, cnt = splitk.WORKSPACE.get(torch.cuda.current_device(), (None, None))
            assert ws is None or (not ws.any() and not cnt.any()), f"dirty workspace after {cfg}"
        out = kbit.kbit_matmul(x, w)  # the default config, no bias
        assert _rel(out, x.double() @ ref.double().t()) < TOL[dtype]


@gpu
def test_gpu_cuda_graph_capture_and_replay():
    planes, absmax, cb, ref = random_weight(1024, 2048, 4, seed=3, device="cuda")
    w = kbit.repack_weight(planes, absmax, cb)
    for M in (1, 16, 128, 1024):
        x = torch.randn(M, 2048, device="cuda", dtype=torch.float16)
        kbit.kbit_matmul(x, w)  # warm-up: compile, size the workspace
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kbit.kbit_matmul(x, w)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert _rel(out, x.double() @ ref.double().t()) < TOL[torch.float16], M


@gpu
def test_gpu_tuned_table_serves_untuned_calls(tmp_path, monkeypatch):
    from quantfw.kernels.kbit.triton import dispatch, tuning

    N, K, bits = 384, 512, 3
    table = tuning.tune_shapes([(N, K, bits)], [1, 64], log=lambda s: None)
    assert set(table[(N, K, bits)]) == {1, 64}
    name = torch.cuda.get_device_name()
    T.TABLES.write_table(tmp_path / T.TABLES.file_name(name), name, table, "test")
    monkeypatch.setenv(T.ENV_DIR, str(tmp_path))
    T.TABLES.cache_clear()
    dispatch._CONFIG_CACHE.clear()
    planes, absmax, cb, ref = random_weight(N, K, bits, seed=9, device="cuda")
    w = kbit.repack_weight(planes, absmax, cb)
    for M, tuned_m in ((1, 1), (3, 64), (64, 64)):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        out = kbit.kbit_matmul(x, w)
        assert dispatch._CONFIG_CACHE[dispatch._key(x, w)] == table[(N, K, bits)][tuned_m]
        assert _rel(out, x.double() @ ref.double().t()) < 2e-3
    dispatch._CONFIG_CACHE.clear()
    T.TABLES.cache_clear()
