"""`benchmarks/ablate_step.py`: its patches reach the code the models run, and leave nothing behind
(CPU; the Triton kernels it replaces are only imported)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

ROOT = os.path.join(os.path.dirname(__file__), "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "ablate_step.py")


def _module():
    spec = importlib.util.spec_from_file_location("ablate_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ablated_norm_passes_the_input_through_the_layer_and_is_undone():
    from quantfw.layers.norm import RMSNorm

    ablate = _module()
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, res = torch.randn(3, 16) * 4, torch.randn(3, 16)
    with ablate.ablated({"norm"}):
        assert norm(x) is x
        out, new_res = norm(x, res)
        assert out is x and new_res is res
    y = norm(x)
    ref = x / (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt() * norm.weight
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_ablated_splits_and_kernels_are_restored():
    from quantfw.kernels.attention import triton_paged
    from quantfw.layers.attention.backends import triton as backend

    ablate = _module()
    before = (triton_paged.paged_decode, triton_paged._merge_splits_kernel, backend.write_kv)
    want = triton_paged.decode_splits(1, 8, 4096)
    with ablate.ablated({"rope", "merge"}, extra_ctas=256, splits=3):
        assert triton_paged.decode_splits(1, 8, 4096) == 3
        assert triton_paged.paged_decode is not before[0]
        q = torch.randn(2, 4, 8)
        assert backend.write_kv(None, q, None, None, None, None) is q
    assert triton_paged.decode_splits(1, 8, 4096) == want
    after = (triton_paged.paged_decode, triton_paged._merge_splits_kernel, backend.write_kv)
    assert after == before


def test_ablated_attn_output_shape():
    from quantfw.kernels.attention import triton_paged

    ablate = _module()
    with ablate.ablated({"attn"}):
        out = triton_paged.paged_decode(torch.randn(2, 4, 8), None, None, None, None, 1.0)
    assert out.shape == (2, 32)


def test_ablated_gemm_returns_the_output_shape_without_a_launch_and_is_undone():
    from quantfw.kernels.fused import GatedAct
    from quantfw.kernels.kbit.triton import dispatch

    ablate = _module()
    before = dispatch.kbit_matmul_cuda
    weight = SimpleNamespace(out_features=64, in_features=32)  # no tensors: nothing to launch
    x = torch.randn(3, 32, dtype=torch.float16)
    with ablate.ablated({"gemm"}):
        out = dispatch.kbit_matmul_cuda(x, weight)
        gated = dispatch.kbit_matmul_cuda(x, weight, act=(GatedAct("silu"), 32))
    assert out.shape == (3, 64) and out.dtype == x.dtype and gated.shape == (3, 32)
    assert dispatch.kbit_matmul_cuda is before


def test_unknown_skip_names_the_supported_ones():
    ablate = _module()
    match = "unknown \\['mlp'\\]; supported: norm, rope, attn, merge, gemm"
    with pytest.raises(ValueError, match=match), ablate.ablated({"mlp"}):
        pass


def test_options_on_a_removed_attention_are_refused():
    ablate = _module()
    with pytest.raises(ValueError, match="--skip attn removes"), ablate.ablated({"attn"}, 256):
        pass


def test_script_runs_a_bench_with_norms_skipped():
    cmd = [sys.executable, SCRIPT, "--skip", "norm", "bench", "tiny-llama", "--methods", "fp16",
           "--batch-sizes", "1", "--prompt-len", "8", "--decode-context", "8",
           "--decode-tokens", "2", "--prefill-repeats", "1", "--no-save"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ablation: skip ['norm']" in run.stderr
    assert "decode tok/s" in run.stdout
