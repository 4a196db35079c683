"""`benchmarks/probe_grid_barrier.py` on the CPU: both chains (one launch a stage; one
persistent kernel with a grid barrier between stages) in Triton's interpreter against the
float32 reference, the counters left clean; the persistent kernel compiled for sm_90 (its
spin and release/acquire atomics)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.join(os.path.dirname(__file__), "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "probe_grid_barrier.py")

_CHECK = f"""
import importlib.util, torch
from script_checks import patch_interpreter_scalar_index
patch_interpreter_scalar_index()
spec = importlib.util.spec_from_file_location("probe", {SCRIPT!r})
probe = importlib.util.module_from_spec(spec); spec.loader.exec_module(probe)
torch.manual_seed(0)
S, D = 3, 48
weights = (torch.randn(S, D, D) / D**0.5).half()
x = torch.randn(D).half()
want = probe.reference(weights, x).float()
bufs = torch.full((S + 1, D), float("nan")).half(); bufs[0] = x
got = probe.chain_launches(weights, bufs, rows=8).float()
assert torch.isfinite(got).all() and (got - want).norm() / want.norm() < 1e-2, "launches"
counters = torch.zeros(S, dtype=torch.int32)
# the interpreter runs programs one after another: one CTA, whose barrier is its own arrival
for ahead in (False, True):
    bufs = torch.full((S + 1, D), float("nan")).half(); bufs[0] = x
    got = probe.chain_persistent(weights, bufs, counters, rows=64, ahead=ahead).float()
    assert torch.isfinite(got).all() and (got - want).norm() / want.norm() < 1e-2, ahead
    assert counters.tolist() == [0] * S, counters
print("OK")
"""


def test_both_chains_match_the_reference_in_the_interpreter():
    env = {
        **os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "support")]),
    }  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_persistent_chain_compiles_for_sm90_without_a_gpu():
    import importlib.util

    from aot import compile_for_sm90  # tests/support is on pytest's path

    spec = importlib.util.spec_from_file_location("probe", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    signature = {"w_ptr": "*fp16", "buf_ptr": "*fp16", "cnt_ptr": "*i32", "D": "i32", "S": "i32"}
    for ahead in (False, True):
        consts = {"ROWS": 8, "DP": 2048, "AHEAD": ahead}
        kernel = compile_for_sm90(probe._chain_kernel, signature, consts, num_warps=4)
        ptx = kernel.asm["ptx"]
        # the arrival a releasing add, the spin an acquiring read
        assert "atom.global.gpu.release.add" in ptx and "ld.global.gpu.acquire" in ptx
        assert "ld.global.cg" in ptx  # the stage input, past L1
        # the loop's weight loads (one stage ahead or the stage's own) go out before its spin
        loop = ptx[ptx.index("Loop Header") :]
        assert loop.index("ld.global.b16") < loop.index("ld.global.gpu.acquire")


def test_stage_kernel_prefetches_the_next_stage_before_its_wait():
    """``launches + L2``: one bulk L2 prefetch (of the CTA's rows of the next stage) before the
    PDL wait, none without it."""
    import importlib.util

    from aot import compile_for_sm90

    spec = importlib.util.spec_from_file_location("probe", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    signature = {"w_ptr": "*fp16", "x_ptr": "*fp16", "y_ptr": "*fp16", "next_ptr": "*fp16",
                 "D": "i32"}  # fmt: skip
    for l2 in (False, True):
        consts = {"ROWS": 8, "DP": 2048, "PDL": True, "L2_NEXT": l2}
        kernel = compile_for_sm90(probe._stage_kernel, signature, consts, num_warps=4,
                                  launch_pdl=True)  # fmt: skip
        ptx = kernel.asm["ptx"]
        assert ptx.count("cp.async.bulk.prefetch.L2.global") == int(l2)
        if l2:
            assert ptx.index("cp.async.bulk.prefetch.L2") < ptx.index("griddepcontrol.wait")
