"""Random paged-attention cases and their dense float64 reference (shared by the CPU, Triton
interpreter and GPU tests).

A case is a ragged batch of sequences, each with some tokens already cached (`cached`) and some
new ones (`new`); the cached keys/values are written into randomly chosen, non-contiguous blocks
of a paged cache, the new ones are handed to the backend, which must store and attend to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantfw.engine.step import slot_mapping
from quantfw.layers.attention import Attention, AttentionMetadata


@dataclass
class PagedCase:
    layer: Attention
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KV, D]
    v: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, its whole context [ctx, KV, D]
    values: list[torch.Tensor]
    cached: list[int]
    new: list[int]
    tables: torch.Tensor  # [B, W] int32
    block_size: int

    def metadata(self, backend) -> AttentionMetadata:
        device = self.q.device
        qsl = torch.tensor([0, *torch.tensor(self.new).cumsum(0).tolist()], dtype=torch.int32)
        ctx = torch.tensor([c + n for c, n in zip(self.cached, self.new)], dtype=torch.int32)
        seq_of = torch.repeat_interleave(torch.arange(len(self.new)), torch.tensor(self.new))
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(self.cached, self.new)])
        tables = self.tables.to(device)
        slots = slot_mapping(tables, seq_of.to(device), positions.to(device), self.block_size)
        return AttentionMetadata(
            backend=backend,
            query_start_loc=qsl.to(device),
            context_lens=ctx.to(device),
            block_tables=[tables],
            slot_mappings=[slots],
            block_size=self.block_size,
            max_query_len=max(self.new),
            max_context_len=int(ctx.max()),
        )

    def reference(self) -> torch.Tensor:
        """Dense float64 attention of every new token: [T, H * D]."""
        layer = self.layer
        group = layer.num_heads // layer.num_kv_heads
        outs, t = [], 0
        for b, (c, n) in enumerate(zip(self.cached, self.new)):
            q = self.q[t : t + n].double().cpu()  # [n, H, D]
            keys = self.keys[b].double().repeat_interleave(group, dim=1)  # [ctx, H, D]
            values = self.values[b].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) * layer.scale
            qpos = torch.arange(c, c + n).view(-1, 1)
            kpos = torch.arange(c + n).view(1, -1)
            allowed = kpos <= qpos
            if layer.sliding_window is not None:
                allowed &= kpos > qpos - layer.sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            if layer.sinks is not None:
                sink = layer.sinks.double().cpu().view(-1, 1, 1).expand(-1, n, 1)
                probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            out = torch.einsum("hqk,khd->qhd", probs, values)
            outs.append(out.reshape(n, -1))
            t += n
        return torch.cat(outs)


def make_case(
    *,
    cached: list[int],
    new: list[int],
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    window: int | None = None,
    sinks: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int | None = None,
) -> PagedCase:
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    layer = Attention(
        heads, head_dim, kv_heads, head_dim**-0.5, sliding_window=window, use_sinks=sinks
    ).to(device)
    if sinks:
        layer.sinks.data.copy_(torch.randn(heads, generator=g) * 2)
    ctx = [c + n for c, n in zip(cached, new)]
    blocks_per_seq = [math.ceil(c / block_size) for c in ctx]
    num_blocks = sum(blocks_per_seq) + 3  # + null block + spares that must stay untouched
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # never the null block
    width = max(blocks_per_seq) + 1
    tables = torch.zeros(len(ctx), width, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype)  # garbage where nothing is written
    v_cache = torch.randn(cache_shape, generator=g).to(dtype)
    keys, values = [], []
    for b, c in enumerate(ctx):
        for i in range(blocks_per_seq[b]):
            tables[b, i] = order.pop()
        kb = torch.randn(c, kv_heads, head_dim, generator=g).to(dtype)
        vb = torch.randn(c, kv_heads, head_dim, generator=g).to(dtype)
        keys.append(kb)
        values.append(vb)
        for p in range(cached[b]):  # the cached prefix is already in the cache
            blk, off = tables[b, p // block_size], p % block_size
            k_cache[blk, off], v_cache[blk, off] = kb[p], vb[p]
    layer.kv_cache = (k_cache.to(device), v_cache.to(device))
    k_new = torch.cat([keys[b][cached[b] :] for b in range(len(ctx))])
    v_new = torch.cat([values[b][cached[b] :] for b in range(len(ctx))])
    q = torch.randn(sum(new), heads, head_dim, generator=g).to(dtype)
    return PagedCase(
        layer, q.to(device), k_new.to(device), v_new.to(device), keys, values, list(cached),
        list(new), tables, block_size,
    )  # fmt: skip
