"""Programmatic dependent launch (PDL, CUDA sm_90+) for the Triton and Gluon kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still
running. It first does what depends on no earlier kernel (loading its weights, filling its
lookup table), then waits (``griddepcontrol.wait``) until the previous kernel has finished and
its writes are visible, and only then reads activations or writes anything. Every kernel here
also lets the next one launch at its start (``griddepcontrol.launch_dependents``), so within a
decode step (a CUDA graph of mostly our kernels) each kernel's launch and weight loads overlap
the end of the one before.

The rule for a kernel that takes part: before `wait` it may read only what no kernel of the
chain writes (weights, scales, codebook tables; the decode attention also reads the step's
metadata, written by torch before the step's first kernel, and the keys and values that earlier
steps cached) and write only its own shared memory; a kernel without `wait` must not be
launched with PDL. Kernels launched without PDL (torch's, cuBLAS) keep the ordinary stream
order. ``QUANTFW_PDL=0`` (or `set_enabled(False)`) turns it off.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantfw.kernels.common import cuda_capability

_OVERRIDE: list[bool | None] = [None]


def set_enabled(flag: bool | None) -> None:
    """Force PDL on or off for later launches (None: back to ``QUANTFW_PDL``, default on).
    Kernels compile once per setting; CUDA graphs keep the setting they were captured with."""
    _OVERRIDE[0] = flag


def enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: a CUDA device of compute capability 9.0 or
    newer, unless turned off."""
    flag = _OVERRIDE[0]
    if flag is None:
        flag = os.environ.get("QUANTFW_PDL", "1") not in ("0", "false", "off")
    if not flag or device.type != "cuda":
        return False
    return cuda_capability(device) >= (9, 0)


def launch_options(on: bool) -> dict:
    """The launch keywords of a kernel taking a ``PDL`` constexpr: ``PDL=on`` and, when on,
    Triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def triton_release(PDL: tl.constexpr):
    """Triton: let the next kernel launch (a no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def triton_wait(PDL: tl.constexpr):
    """Triton: wait until the previous kernel has finished and its writes are visible (a no-op
    without PDL). Loads issued before it in program order stay before it."""
    if PDL:
        gdc_wait()


@triton.jit
def wait_and_release(PDL: tl.constexpr):
    """Triton: let the next kernel launch, then wait for the previous one (no-ops without
    PDL)."""
    triton_release(PDL)
    triton_wait(PDL)


@gluon.jit
def release(PDL: gl.constexpr):
    """Gluon: let the next kernel launch (its CTAs wait for this one to finish)."""
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip


@gluon.jit
def wait(PDL: gl.constexpr):
    """Gluon: wait until the previous kernel has finished and its writes are visible. Returns
    an int32 zero produced after the wait: add it to the offsets of the loads that must follow
    (the compiler may move a load across the wait, never before a value it depends on)."""
    if PDL:
        return gl.inline_asm_elementwise(
            "griddepcontrol.wait;\n\tmov.b32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip
    else:
        return 0
