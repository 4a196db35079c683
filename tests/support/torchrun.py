"""Launch a script of ``tests/scripts/`` on two ranks under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def torchrun2(script: str, *args: str, timeout: float = 300) -> None:
    """Run ``tests/scripts/<script> args`` on two ranks; its output in the error if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [*cmd, os.path.join(SCRIPTS, script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]


def tp2_logits(cases: list, batches: list[torch.Tensor], tmp_path: Path) -> list[dict]:
    """Per case ``[folder, load_model kwargs]``: rank 0's ``{"logits": [one per batch]}`` or
    ``{"error": message}`` of the model loaded at TP = 2 (``tp_load_logits.py``)."""
    torch.save(batches, tmp_path / "ids.pt")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    paths = (str(tmp_path / n) for n in ("cases.json", "ids.pt", "out.pt"))
    torchrun2("tp_load_logits.py", *paths, timeout=600)
    return torch.load(tmp_path / "out.pt")
