"""Pull a tensor into L2 during a kernel whose own work leaves DRAM idle (CUDA sm_90+).

A decode step's small kernels (attention, its split merge) read little, so DRAM has nothing to
do while they run; the dense GEMV after them then streams its weights from DRAM. A kernel that
knows which weights come next can ask L2 for them (``cp.async.bulk.prefetch.L2``: no data comes
back to the SM, nothing waits on it), spread over its programs, so that the GEMV reads L2
instead (`benchmarks/decode-lab-log.md` experiments 21-22).

`plan` decides on the host (fixed for a CUDA graph): the tensor's bytes split into one 16-byte
aligned slice per program, or None where it would not help or not fit (not CUDA sm_90, not
contiguous, more than `MAX_L2_SHARE` of L2). `prefetch_slice` is the device side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantfw.kernels.common import cuda_capability

#: at most this share of the GPU's L2 is asked for at once, so that the kernel's own data and
#: what the next kernels read besides stay resident
MAX_L2_SHARE = 0.75

#: PTX: thread 0 asks L2 for $2 bytes from $1 (sm_90 bulk prefetch; $0 is a dummy)
_PREFETCH_ASM = tl.constexpr(
    "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;"
    " @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)


@dataclass(frozen=True)
class L2Prefetch:
    """A tensor's bytes as ``programs`` slices of ``slice_bytes`` (the last one shorter)."""

    tensor: torch.Tensor
    slice_bytes: int
    total_bytes: int


def plan(tensor: torch.Tensor | None, programs: int) -> L2Prefetch | None:
    """How ``programs`` programs of a kernel pull ``tensor`` into L2, or None (no tensor, not
    on a CUDA sm_90+ device, not contiguous, or larger than `MAX_L2_SHARE` of L2)."""
    if tensor is None or tensor.device.type != "cuda" or not tensor.is_contiguous():
        return None
    if cuda_capability(tensor.device) < (9, 0) or programs < 1:
        return None
    total = tensor.numel() * tensor.element_size() // 16 * 16
    l2 = torch.cuda.get_device_properties(tensor.device).L2_cache_size
    if total == 0 or total > MAX_L2_SHARE * l2 or tensor.data_ptr() % 16:
        return None
    return L2Prefetch(tensor, slice_bytes(total, programs), total)


def slice_bytes(total: int, programs: int) -> int:
    """Bytes a program asks for: ``total`` over ``programs``, rounded up to 16 (the bulk
    prefetch's unit), so that the slices tile ``[0, total)`` and start 16-byte aligned."""
    return triton.cdiv(triton.cdiv(total, programs), 16) * 16


@triton.jit
def prefetch_slice(base_ptr, program, slice_bytes, total_bytes):
    """Program ``program``'s slice of the bytes at ``base_ptr`` (any element type) into L2:
    bytes ``[program * slice_bytes, min(total_bytes, (program + 1) * slice_bytes))``."""
    start = program.to(tl.int64) * slice_bytes
    size = tl.minimum(total_bytes - start, slice_bytes)
    if size > 0:
        at = (base_ptr.to(tl.pointer_type(tl.int8)) + start) + tl.zeros([1], tl.int32)
        tl.inline_asm_elementwise(
            _PREFETCH_ASM, "=r,l,r", [at, size.to(tl.int32) + tl.zeros([1], tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
