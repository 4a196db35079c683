"""Our Triton kernels (paged attention, fused small ops) run through Triton's interpreter on the
CPU (TRITON_INTERPRET=1, small sizes) and match the references: the same kernel code the GPU runs,
checked for indexing, masking and the online-softmax arithmetic without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "triton_interpret_check.py")
SUPPORT = os.path.join(os.path.dirname(__file__), "..", "support")


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": SUPPORT, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, SCRIPT], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAIL" not in proc.stdout
