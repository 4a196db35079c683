"""The KV cache: one preallocated slot of `max_model_len` tokens per concurrent sequence.

Per attention layer a key and a value tensor ``[num_slots + 1, max_model_len, kv_heads, head_dim]``
(the extra slot is scratch for padded rows of CUDA-graph batches). The number of slots is the
smaller of `max_num_seqs` and what fits in ``memory_utilization`` of the device memory still
free after the weights. Under tensor parallelism every rank holds its own kv heads and all ranks
agree on the smallest slot count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from quantfw import distributed as qdist
from quantfw.layers.attention import Attention


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def available_memory_bytes(device: torch.device, memory_utilization: float) -> int:
    """Bytes the cache may use: on CUDA, ``utilization * total`` minus what is already used;
    on the CPU, ``utilization`` of the memory the OS reports available."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * memory_utilization) - (total - free)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = 8 << 30
    return int(available * memory_utilization)


class KVCache:
    """Allocates the cache tensors, binds them to the model's attention layers and hands out
    slots (lowest free first)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_model_len: int,
        max_num_seqs: int,
        dtype: torch.dtype,
        device: torch.device,
        memory_utilization: float,
    ):
        layers = attention_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} has no Attention layers to cache")
        kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        elem = torch.empty((), dtype=dtype).element_size()
        bytes_per_slot = 2 * len(layers) * max_model_len * kv_heads * head_dim * elem
        budget = available_memory_bytes(device, memory_utilization)
        num_slots = min(max_num_seqs, budget // bytes_per_slot - 1)
        num_slots = _min_over_tp(int(num_slots), device)
        if num_slots < 1:
            raise ValueError(
                f"not enough memory for a KV cache slot of max_model_len={max_model_len} "
                f"({bytes_per_slot / 2**20:.1f} MiB per sequence, {max(budget, 0) / 2**20:.1f} "
                "MiB available): lower max_model_len or raise gpu_memory_utilization"
            )
        self.num_slots = num_slots
        self.pad_slot = num_slots  # scratch slot for padded rows
        self.max_model_len = max_model_len
        self.bytes_per_slot = bytes_per_slot
        shape = (num_slots + 1, max_model_len, kv_heads, head_dim)
        self.tensors = []
        for layer in layers:
            kv = (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            layer.kv_cache = kv
            self.tensors.append(kv)
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV cache slot")
        self._free.sort()
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        if slot < 0 or slot >= self.num_slots or slot in self._free:
            raise ValueError(f"KV cache slot {slot} is not allocated")
        self._free.append(slot)


def _min_over_tp(value: int, device: torch.device) -> int:
    if qdist.get_tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=qdist.get_tp_group())
    return int(t.item())
