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


def patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds a runtime scalar as a 1-element array and reads it with
    ``int(array)``, which numpy >= 2.4 refuses (``range(runtime_int)`` in a kernel fails); make
    the patched ``tl.tensor.__index__`` read the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
