"""The paged KV cache: fixed-size blocks shared by all sequences, sized from free memory.

Per attention layer a key and a value tensor ``[num_blocks, block_size, kv_heads, head_dim]``.
Layers are grouped by attention span (`KVCacheGroup`): full-attention layers in one group, the
layers of each sliding window in another. A sliding-window group only ever holds the blocks its
windows can see (`BlockManager`), so it gets a fixed share: ``max_num_seqs`` windows plus one
step's worth of new tokens; full-attention layers get the rest of the memory budget. Under tensor
parallelism every rank holds its own kv heads and all ranks agree on the smallest block counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from quantfw import distributed as qdist
from quantfw.engine.block_manager import BlockManager
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


@dataclass
class KVCacheGroup:
    """Attention layers that share block tables: same sliding window (None: full attention)."""

    sliding_window: int | None
    layers: list[Attention]
    num_blocks: int = 0

    def tokens(self, block_size: int) -> int:
        """Tokens of cache one layer of this group holds (the null block excluded)."""
        return (self.num_blocks - 1) * block_size


def _groups(layers: list[Attention], max_model_len: int) -> list[KVCacheGroup]:
    by_window: dict[int | None, list[Attention]] = {}
    for layer in layers:
        window = layer.sliding_window
        if window is not None and window >= max_model_len:
            window = None  # the window never drops a token: full attention for the cache
        by_window.setdefault(window, []).append(layer)
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return [KVCacheGroup(w, by_window[w]) for w in order]


class KVCache:
    """Allocates the block tensors, binds them to the model's attention layers and owns the
    `BlockManager` that hands blocks to sequences."""

    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        memory_utilization: float,
        num_blocks: int | None = None,
    ):
        layers = attention_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} has no Attention layers to cache")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size} must be a power of two")
        shapes = {(layer.num_kv_heads, layer.head_dim) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"attention layers differ in (kv_heads, head_dim): {sorted(shapes)}")
        kv_heads, head_dim = shapes.pop()
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_bytes = 2 * block_size * kv_heads * head_dim * elem  # one layer, K and V
        self.groups = _groups(layers, max_model_len)
        step_blocks = -(-max_num_batched_tokens // block_size)
        seq_blocks = -(-max_model_len // block_size)
        # blocks a group needs at least (null block included): one sequence of max_model_len
        # for full attention; for a window, max_num_seqs windows plus one step of new tokens
        minimum, fixed = [], []
        for g in self.groups:
            if g.sliding_window is None:
                minimum.append(seq_blocks + 1)
                fixed.append(None)
            else:
                window_blocks = -(-g.sliding_window // block_size) + 1
                need = max_num_seqs * window_blocks + step_blocks + 1
                minimum.append(min(need, seq_blocks + 1))
                fixed.append(min(need, max_num_seqs * seq_blocks + 1))
        budget = available_memory_bytes(device, memory_utilization)
        counts = self._size(budget, fixed, num_blocks, max_num_seqs * seq_blocks + 1)
        counts = _min_over_tp(counts, device)
        for g, count, low in zip(self.groups, counts, minimum):
            if count < low:
                kind = (
                    "full-attention" if g.sliding_window is None else f"window-{g.sliding_window}"
                )
                raise ValueError(
                    f"not enough memory for the KV cache: the {kind} layers need {low} blocks of "
                    f"{block_size} tokens ({low * self.block_bytes * len(g.layers) / 2**20:.1f} MiB;"
                    f" max_model_len={max_model_len}, max_num_seqs={max_num_seqs}) and "
                    f"{max(budget, 0) / 2**20:.1f} MiB are available for the cache: lower "
                    "max_model_len or raise gpu_memory_utilization"
                )
            g.num_blocks = count
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, g in enumerate(self.groups):
            shape = (g.num_blocks, block_size, kv_heads, head_dim)
            for layer in g.layers:
                kv = (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                layer.kv_cache = kv
                layer.kv_group = index
                self.tensors.append(kv)
        self.blocks = BlockManager(
            block_size, [g.sliding_window for g in self.groups], [g.num_blocks for g in self.groups]
        )
        self.initial_free = self.blocks.num_free

    def _size(
        self, budget: int, fixed: list[int | None], override: int | None, most: int
    ) -> list[int]:
        """Block count per group: sliding groups their fixed share, full attention the rest of
        the budget, up to `most` (what max_num_seqs sequences of max_model_len can use)."""
        if override is not None:
            return [override if f is None else min(f, override) for f in fixed]
        counts = [f or 0 for f in fixed]
        spent = sum(c * len(g.layers) for c, g in zip(counts, self.groups)) * self.block_bytes
        full = [i for i, f in enumerate(fixed) if f is None]
        if full:
            per_block = sum(len(self.groups[i].layers) for i in full) * self.block_bytes
            for i in full:
                counts[i] = min(most, max(0, (budget - spent) // per_block))
        return counts

    @property
    def num_free(self) -> int:
        """Free blocks over all groups (returns to `initial_free` when no sequence holds any)."""
        return self.blocks.num_free

    @property
    def windows(self) -> list[int | None]:
        return [g.sliding_window for g in self.groups]

    def capacity_tokens(self) -> int:
        """Tokens of full-attention context the cache holds (all sequences together)."""
        full = [g for g in self.groups if g.sliding_window is None] or self.groups
        return min(g.tokens(self.block_size) for g in full)

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.tensors)


def _min_over_tp(values: list[int], device: torch.device) -> list[int]:
    if qdist.get_tp_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=qdist.get_tp_group())
    return [int(v) for v in t.tolist()]
