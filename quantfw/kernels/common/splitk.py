"""Host-side helpers of split-K kernels that every family shares: SM counts, the split plan,
and the self-cleaning fp32 workspace with arrival counters.

A split-K launch has several CTAs per output tile along K; each adds its partial sums into the
workspace, bumps the tile's counter, and the last CTA to arrive reads the sums (leaving zeros)
and resets the counter. So one launch does the whole matmul and the buffers are clean for the
next call or CUDA-graph replay.
"""

from __future__ import annotations

import functools

import torch

WORKSPACE: dict[int | str, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []  # outgrown; captured graphs may use them
_NUM_SMS: dict[int, int] = {}


def _index(device) -> int | str:
    """The CUDA device index (the current device for a bare "cuda"); other devices (the CPU,
    for kernels run by Triton's interpreter) by type."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device) -> int:
    """Multiprocessors of a CUDA device; 4 for the CPU (Triton's interpreter), so that small
    test shapes still plan a split along K."""
    idx = _index(device)
    if isinstance(idx, str):
        return 4
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def workspace(device, n_ws: int, n_cnt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed fp32 partial sums and int32 arrival counters, shared by all calls on a device.

    Every split-K launch leaves them zeroed again, so they are allocated once; calls on one
    device must be stream-ordered (as a model's are). When a larger shape needs bigger buffers,
    the old ones are kept alive (`_RETIRED`): CUDA graphs captured before keep using the buffers
    they were captured with, and freeing those lets the allocator hand their memory to other
    tensors that the graphs then overwrite (seen as illegal addresses in AWQ decode after an
    eager step grew the workspace). Every shape should still be run once before capture so that
    no buffer grows inside it."""
    idx = _index(device)
    ws, cnt = WORKSPACE.get(idx, (None, None))
    if ws is None or ws.numel() < n_ws or cnt.numel() < n_cnt:
        if ws is not None:
            _RETIRED.append((ws, cnt))
        n_ws = max(n_ws, 0 if ws is None else ws.numel())
        n_cnt = max(n_cnt, 0 if cnt is None else cnt.numel())
        ws = torch.zeros(n_ws, device=device, dtype=torch.float32)
        cnt = torch.zeros(n_cnt, device=device, dtype=torch.int32)
        WORKSPACE[idx] = (ws, cnt)
    return ws, cnt


@functools.lru_cache(maxsize=4096)
def split_plan(
    steps: int, tiles: int, sms: int, ctas_per_sm: int, even: bool = False
) -> tuple[int, int]:
    """(split, n_iter) for kernels whose CTAs each run a contiguous range of ``n_iter`` of the
    ``steps`` chunks/stages: the most CTAs per output tile along K that fit in ``ctas_per_sm *
    sms`` (any count, so a small grid fills the GPU); ``even``: n_iter rounded up to even when
    above 1 (a kernel that runs stages in pairs; the extra one reads zeros past K)."""
    split = max(1, min(steps, ctas_per_sm * sms // tiles))
    n_iter = -(-steps // split)
    if even and n_iter > 1:
        n_iter += n_iter % 2
    return -(-steps // n_iter), n_iter
