"""Launch ``tests/scripts/tp_load_logits.py`` on two ranks under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "tp_load_logits.py")


def tp2_logits(cases: list, batches: list[torch.Tensor], tmp_path: Path) -> list[dict]:
    """Per case ``[folder, load_model kwargs]``: rank 0's ``{"logits": [one per batch]}`` or
    ``{"error": message}`` of the model loaded at TP = 2."""
    torch.save(batches, tmp_path / "ids.pt")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [SCRIPT, *(str(tmp_path / n) for n in ("cases.json", "ids.pt", "out.pt"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return torch.load(tmp_path / "out.pt")
