"""Runs one `StepBatch` through the model: builds the attention metadata, calls the cache-aware
forward, returns the logits of the rows to sample. Decode steps replay CUDA graphs when enabled.

Under tensor parallelism the leader broadcasts each `StepBatch` before running it and the other
ranks sit in `worker_loop`, running exactly the same steps; only the leader samples.
"""

from __future__ import annotations

import torch
from torch import nn

from quantfw import distributed as qdist
from quantfw.engine.kv_cache import KVCache
from quantfw.engine.scheduler import StepBatch
from quantfw.layers.attention import AttentionBackend, AttentionMetadata, SDPABackend


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def build_metadata(
    batch: StepBatch, backend: AttentionBackend, max_model_len: int, device: torch.device
) -> AttentionMetadata:
    max_q = max(batch.query_lens)
    starts = [0]
    query_pos: list[int] = []
    flat_to_padded: list[int] = []
    for b, n in enumerate(batch.query_lens):
        start = starts[-1]
        starts.append(start + n)
        pos = batch.positions[start : start + n]
        query_pos.extend(pos + [0] * (max_q - n))
        flat_to_padded.extend(range(b * max_q, b * max_q + n))
    write_index = []
    for slot, n, start in zip(batch.slots, batch.query_lens, starts):
        write_index.extend(slot * max_model_len + p for p in batch.positions[start : start + n])
    return AttentionMetadata(
        backend=backend,
        slot_ids=_long(batch.slots, device),
        context_lens=_long(batch.context_lens, device),
        query_start_loc=_long(starts, device),
        write_index=_long(write_index, device),
        query_pos=_long(query_pos, device).view(len(batch.slots), max_q),
        flat_to_padded=_long(flat_to_padded, device),
        max_query_len=max_q,
        max_context_len=_context_bucket(max(batch.context_lens), max_model_len),
    )


#: Attention reads the cache up to a multiple of this many positions (the mask hides the rest),
#: so eager steps see a new key length once per bucket instead of once per token: attention
#: libraries plan per shape (cuDNN SDPA on Hopper spent ~40 ms re-planning every decode step).
CONTEXT_BUCKET = 256


def _context_bucket(length: int, max_model_len: int) -> int:
    return min(max_model_len, -(-length // CONTEXT_BUCKET) * CONTEXT_BUCKET)


class DecodeGraphs:
    """CUDA graphs of the decode step, one per batch-size bucket, over static input buffers.

    Graphs attend with `SDPABackend` over the full `max_model_len` (shapes must not change
    between replays); padded rows write into the cache's scratch slot.
    """

    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device, max_bs: int):
        self.model = model
        self.max_len = kv_cache.max_model_len
        self.pad_slot = kv_cache.pad_slot
        self.buckets = sorted({min(2**i, max_bs) for i in range(max_bs.bit_length() + 1)})
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_ids = torch.full((n,), self.pad_slot, dtype=torch.long, device=device)
        self.context_lens = torch.ones(n, dtype=torch.long, device=device)
        self.write_index = torch.full(
            (n,), self.pad_slot * self.max_len, dtype=torch.long, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.backend = SDPABackend()
        self.pool = None
        for bs in reversed(self.buckets):  # largest first so smaller ones reuse its pool
            self._capture(bs)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            backend=self.backend,
            slot_ids=self.slot_ids[:bs],
            context_lens=self.context_lens[:bs],
            query_start_loc=torch.arange(bs + 1, device=self.input_ids.device),
            write_index=self.write_index[:bs],
            query_pos=self.positions[:bs].view(bs, 1),
            flat_to_padded=torch.arange(bs, device=self.input_ids.device),
            max_query_len=1,
            max_context_len=self.max_len,
        )

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        self.backend.prepare(meta)
        hidden = self.model.forward_cached(self.input_ids[:bs], self.positions[:bs], meta)
        return self.model.compute_logits(hidden)

    def _capture(self, bs: int) -> None:
        meta = self._meta(bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(bs, self._meta(bs))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bs] = self._forward(bs, meta)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs] = graph

    def can_run(self, batch: StepBatch) -> bool:
        return batch.is_decode and len(batch.slots) <= self.buckets[-1]

    def run(self, batch: StepBatch) -> torch.Tensor:
        b = len(batch.slots)
        bs = next(x for x in self.buckets if x >= b)
        dev = self.input_ids.device
        self.input_ids[:b].copy_(_long(batch.input_ids, dev))
        self.positions[:b].copy_(_long(batch.positions, dev))
        self.slot_ids[:b].copy_(_long(batch.slots, dev))
        self.context_lens[:b].copy_(_long(batch.context_lens, dev))
        self.write_index[:b].copy_(self.slot_ids[:b] * self.max_len + self.positions[:b])
        self.input_ids[b:bs].zero_()
        self.positions[b:bs].zero_()
        self.slot_ids[b:bs].fill_(self.pad_slot)
        self.context_lens[b:bs].fill_(1)
        self.write_index[b:bs].fill_(self.pad_slot * self.max_len)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        *,
        cuda_graphs: bool,
        max_graph_batch: int,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            if device.type != "cuda":
                raise ValueError("cuda_graphs=True needs a CUDA device")
            with torch.inference_mode():
                self.graphs = DecodeGraphs(model, kv_cache, device, max_graph_batch)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits [len(batch.sample_rows), vocab] (float32) of this step."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch).float()
        meta = build_metadata(batch, self.backend, self.kv_cache.max_model_len, self.device)
        self.backend.prepare(meta)
        hidden = self.model.forward_cached(
            _long(batch.input_ids, self.device), _long(batch.positions, self.device), meta
        )
        if not batch.sample_rows:  # only prefill chunks this step
            return hidden.new_empty(0, 0, dtype=torch.float32)
        rows = _long(batch.sample_rows, self.device)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Leader side: send the step to the other TP ranks, then run it."""
        if qdist.get_tp_size() > 1:
            qdist.broadcast_object(batch)
        return self.run(batch)

    def worker_loop(self) -> None:
        """Non-leader TP ranks: run every step the leader broadcasts until it sends None."""
        while True:
            batch = qdist.broadcast_object(None)
            if batch is None:
                return
            self.run(batch)

    def stop_workers(self) -> None:
        if qdist.get_tp_size() > 1 and qdist.is_tp_leader():
            qdist.broadcast_object(None)
