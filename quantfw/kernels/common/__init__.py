"""What every kernel family shares: tuned config tables per GPU model (``tables``; pure Python),
the rotated-weight CUDA-graph timer used by tuning and the benchmarks (``timing``), split-K
workspaces (``splitk``), whether Triton is installed (`triton_available`), and a CUDA device's
compute capability (`cuda_capability`, cached per device; `is_sm90`)."""

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


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


def cuda_capability(device) -> tuple[int, int]:
    """(major, minor) of a CUDA ``torch.device`` (a bare "cuda": the current one), looked up
    once per device."""
    if device.index is not None:
        return _capability(device.index)
    import torch

    return _capability(torch.cuda.current_device())


def is_sm90(device) -> bool:
    """Whether `device` is a Hopper (sm_90) CUDA device: the target of the TMA / wgmma kernels
    and of the configs measured there (other GPUs have not run them)."""
    return device.type == "cuda" and cuda_capability(device) == (9, 0)
