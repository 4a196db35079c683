"""`benchmarks/bench_mxfp4.py`'s config sweep (CPU: the grid is pure; the kernels are only
imported)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_mxfp4.py")


def _module():
    spec = importlib.util.spec_from_file_location("bench_mxfp4", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tokens", [1, 16, 512, 2048])
@pytest.mark.parametrize("quantized", [True, False])
def test_the_sweep_times_the_layers_own_config_first_and_once(tokens, quantized):
    bench = _module()
    from quantfw.kernels.mxfp4.triton import grouped_gemm

    rows = tokens * bench.TOP_K
    default = grouped_gemm.default_config(
        rows, bench.E, 2 * bench.INTER, bench.H, mxfp4=quantized, dtype=torch.bfloat16,
        hopper=True,
    )  # fmt: skip
    per_expert = rows / min(bench.E, rows)
    grid = bench.sweep_for(per_expert, quantized, default)
    assert grid[0] == default
    assert grid.count(default) == 1
    assert len(grid) > 1
    assert grid[1:] == [c for c in bench.sweep_for(per_expert, quantized) if c != default]
    if not quantized:
        assert not any(c.get(k) for c in grid for k in ("LUT", "DEQUANT", "WGMMA"))
