"""What the standalone check scripts share: one line per check, failures collected."""

from __future__ import annotations

import torch

FAILED: list[str] = []


def check(name: str, err: float, tol: float) -> None:
    ok = err <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {err:.2e} (<= {tol:g})")
    if not ok:
        FAILED.append(name)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
