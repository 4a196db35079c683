"""Process groups for tensor parallelism, initialised from torchrun's environment.

Everything here works at world size 1 without any process group: collectives become no-ops.
Ranks are grouped into tensor-parallel groups of consecutive ranks ([0..tp-1], [tp..2tp-1], ...).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _TPState:
    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None


_state = _TPState()
#: bound methods (held weakly) that `destroy_distributed` calls before the teardown
_teardown_hooks: list[weakref.WeakMethod] = []


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_device() -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank_from_env() % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(
    tensor_parallel_size: int | None = None, *, backend: str | None = None
) -> None:
    """Initialise torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and the TP group.

    `tensor_parallel_size` defaults to the world size and must divide it. Safe to call again with
    the same size; a different size after initialisation is an error. A process group created
    here is destroyed at interpreter exit unless ``destroy_distributed`` ran first.
    """
    world = world_size_from_env()
    tp = world if tensor_parallel_size is None else int(tensor_parallel_size)
    if tp < 1 or world % tp != 0:
        raise ValueError(
            f"tensor_parallel_size={tp} must be >= 1 and divide the world size {world} "
            "(WORLD_SIZE from torchrun)"
        )
    if _state.size != 1 or _state.group is not None:
        if _state.size != tp:
            raise RuntimeError(
                f"tensor parallelism already initialised with size {_state.size}, asked for {tp}"
            )
        return
    if world == 1:
        _state.size, _state.rank, _state.group = 1, 0, None
        return
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(default_device())
        timeout = datetime.timedelta(seconds=int(os.environ.get("QUANTFW_DIST_TIMEOUT_S", "600")))
        dist.init_process_group(backend=backend, timeout=timeout)
        # a group left to interpreter teardown can abort the process ("terminate called
        # without an active exception", seen with gloo under torchrun): destroy it at exit
        atexit.register(destroy_distributed)
    rank = dist.get_rank()
    group = None
    for start in range(0, world, tp):
        ranks = list(range(start, start + tp))
        # new_group must be called by every rank for every group, in the same order.
        candidate = dist.new_group(ranks)
        if rank in ranks:
            group = candidate
    _state.size, _state.rank, _state.group = tp, rank % tp, group


def on_teardown(method: Callable[[], None]) -> None:
    """Have `destroy_distributed` call ``method``, a bound method (held weakly: a collected
    owner is skipped), before it tears the process group down. Engines drop their decode CUDA
    graphs this way: graphs that captured NCCL collectives and are still alive make the
    teardown hang (two H100s, torch 2.11); `init_distributed` runs the teardown at interpreter
    exit when it created the group, so an `LLM` still referenced then is covered too."""
    _teardown_hooks[:] = [ref for ref in _teardown_hooks if ref() is not None]
    _teardown_hooks.append(weakref.WeakMethod(method))


def destroy_distributed() -> None:
    """Tear down the TP state and the default process group, if any: first the `on_teardown`
    hooks, then a garbage collection and a device sync, so that nothing still refers to the
    group's communicators."""
    _state.size, _state.rank, _state.group = 1, 0, None
    if dist.is_initialized():
        hooks, _teardown_hooks[:] = list(_teardown_hooks), []
        try:
            for ref in hooks:
                method = ref()
                if method is not None:
                    method()
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        finally:
            dist.destroy_process_group()


def get_tp_size() -> int:
    return _state.size


def get_tp_rank() -> int:
    return _state.rank


def get_tp_group() -> dist.ProcessGroup | None:
    return _state.group


def is_tp_leader() -> bool:
    """True on TP rank 0 (the rank that prints, samples and answers)."""
    return _state.rank == 0


@contextlib.contextmanager
def simulated_tp(size: int, rank: int = 0) -> Iterator[None]:
    """Pretend to be TP rank `rank` of `size` without any process group.

    Used to plan shards (``quantfw info``) and to test sharding arithmetic in one process;
    collectives must not run inside it.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside tensor-parallel size {size}")
    saved = _TPState(_state.size, _state.rank, _state.group)
    _state.size, _state.rank, _state.group = size, rank, None
    try:
        yield
    finally:
        _state.size, _state.rank, _state.group = saved.size, saved.rank, saved.group


def _check_group() -> None:
    if _state.group is None:
        raise RuntimeError(
            "a collective ran under simulated tensor parallelism (no process group); "
            "run under torchrun to execute a sharded model"
        )


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group (in place when sharded); identity at TP size 1."""
    if _state.size == 1:
        return x
    _check_group()
    dist.all_reduce(x, group=_state.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`; identity at TP size 1."""
    if _state.size == 1:
        return x
    _check_group()
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, src_tp_rank: int = 0) -> torch.Tensor:
    """Broadcast `x` in place from TP rank `src_tp_rank`; identity at TP size 1."""
    if _state.size == 1:
        return x
    _check_group()
    dist.broadcast(x, src=dist.get_global_rank(_state.group, src_tp_rank), group=_state.group)
    return x


def broadcast_object(obj: object, src_tp_rank: int = 0) -> object:
    """Broadcast a picklable object from TP rank `src_tp_rank`; identity at TP size 1."""
    if _state.size == 1:
        return obj
    _check_group()
    box = [obj]
    dist.broadcast_object_list(
        box, src=dist.get_global_rank(_state.group, src_tp_rank), group=_state.group
    )
    return box[0]
