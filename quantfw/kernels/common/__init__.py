"""What every kernel family shares: tuned config tables per GPU model (``tables``; pure Python),
the rotated-weight CUDA-graph timer used by tuning and the benchmarks (``timing``), split-K
workspaces (``splitk``), and whether Triton is installed (`triton_available`)."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """Whether the triton package imports (checked once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
