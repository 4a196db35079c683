"""Runs one `StepBatch` through the model: packs it into one int32 tensor, builds the attention
metadata on the device, calls the cache-aware forward, returns the logits of the rows to sample.
Decode steps replay CUDA graphs when enabled.

Under tensor parallelism the leader broadcasts each step as two tensors (an 8-int header, then
the packed payload) and the other ranks sit in `worker_loop`, running exactly the same steps
from the same tensors; only the leader samples. No Python object is pickled per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantfw import distributed as qdist
from quantfw.engine.kv_cache import KVCache
from quantfw.engine.scheduler import StepBatch
from quantfw.layers.attention import AttentionBackend, AttentionMetadata

_STEP, _STOP = 0, 1
HEADER_LEN = 8

#: The SDPA backend reads the cache up to a multiple of this many positions (the mask hides the
#: rest), so eager steps see a new key length once per bucket instead of once per token:
#: attention libraries plan per shape (cuDNN SDPA on Hopper re-planned every decode step).
CONTEXT_BUCKET = 256


@dataclass
class PackedStep:
    """A step as the runner executes it: host ints + one int32 device tensor laid out as
    ``input_ids[T] positions[T] context_lens[B] seq_of[T] query_start_loc[B+1]
    block_tables[G][B][W] sample_rows[S]``."""

    num_tokens: int
    num_seqs: int
    table_width: int
    num_sample: int
    max_query_len: int
    max_context_len: int
    num_groups: int
    payload: torch.Tensor

    def header(self) -> list[int]:
        return [
            _STEP, self.num_tokens, self.num_seqs, self.table_width, self.num_sample,
            self.max_query_len, self.max_context_len, self.num_groups,
        ]  # fmt: skip

    @classmethod
    def from_header(cls, header: list[int], payload: torch.Tensor) -> PackedStep:
        return cls(*header[1:], payload=payload)

    @property
    def payload_len(self) -> int:
        t, b = self.num_tokens, self.num_seqs
        return 3 * t + 2 * b + 1 + self.num_groups * b * self.table_width + self.num_sample

    def split(self) -> dict[str, torch.Tensor]:
        t, b, w, g = self.num_tokens, self.num_seqs, self.table_width, self.num_groups
        sizes = [t, t, b, t, b + 1, g * b * w, self.num_sample]
        names = ["input_ids", "positions", "context_lens", "seq_of", "query_start_loc",
                 "block_tables", "sample_rows"]  # fmt: skip
        parts = dict(zip(names, self.payload.split(sizes)))
        parts["block_tables"] = parts["block_tables"].view(g, b, w)
        return parts


def table_width(max_context_len: int, block_size: int, max_model_len: int) -> int:
    """Block-table columns a step carries: enough for the SDPA context bucket."""
    bucket = min(max_model_len, -(-max_context_len // CONTEXT_BUCKET) * CONTEXT_BUCKET)
    return -(-max(bucket, max_context_len) // block_size)


def pack(batch: StepBatch, block_size: int, max_model_len: int) -> PackedStep:
    b, groups = batch.num_seqs, len(batch.block_tables)
    max_ctx = max(batch.context_lens)
    width = table_width(max_ctx, block_size, max_model_len)
    seq_of: list[int] = []
    starts = [0]
    for i, n in enumerate(batch.query_lens):
        seq_of.extend([i] * n)
        starts.append(starts[-1] + n)
    tables: list[int] = []
    for g in range(groups):
        for row in batch.block_tables[g]:
            tables.extend(row)
            tables.extend([0] * (width - len(row)))
    values = (
        batch.input_ids + batch.positions + batch.context_lens + seq_of + starts + tables
        + batch.sample_rows
    )  # fmt: skip
    payload = torch.tensor(values, dtype=torch.int32)
    return PackedStep(
        len(batch.input_ids), b, width, len(batch.sample_rows), max(batch.query_lens), max_ctx,
        groups, payload,
    )  # fmt: skip


def slot_mapping(
    tables: torch.Tensor, seq_of: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat cache row of each token: ``tables[seq, pos // block_size] * block_size + pos %
    block_size`` (int64)."""
    pos = positions.long()
    block = tables[seq_of.long(), pos // block_size].long()
    return block * block_size + pos % block_size


def build_metadata(
    step: PackedStep, parts: dict[str, torch.Tensor], backend: AttentionBackend, block_size: int
) -> AttentionMetadata:
    tables = list(parts["block_tables"].unbind(0))
    slots = [slot_mapping(t, parts["seq_of"], parts["positions"], block_size) for t in tables]
    return AttentionMetadata(
        backend=backend,
        query_start_loc=parts["query_start_loc"],
        context_lens=parts["context_lens"],
        block_tables=tables,
        slot_mappings=slots,
        block_size=block_size,
        max_query_len=step.max_query_len,
        max_context_len=step.max_context_len,
    )


class DecodeGraphs:
    """CUDA graphs of the decode step, one per batch-size bucket, over static input buffers.

    The graphs attend over the real context lengths (a tensor) through block tables of
    ``max_model_len / block_size`` columns; padded rows attend to one token of the null block
    and write there.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        max_bs: int,
    ):
        self.model = model
        self.backend = backend
        self.block_size = kv_cache.block_size
        self.max_model_len = kv_cache.max_model_len
        self.buckets = sorted({min(2**i, max_bs) for i in range(max_bs.bit_length() + 1)})
        n = self.buckets[-1]
        cols = -(-self.max_model_len // self.block_size)
        # rows: input_ids, positions, context_lens (the payload's first 3 * B values for decode)
        self.inputs = torch.zeros(3, n, dtype=torch.int32, device=device)
        self.inputs[2].fill_(1)
        self.tables = torch.zeros(len(kv_cache.groups), n, cols, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_of = torch.arange(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        # run every bucket before capturing any, so that buffers kernels grow on first use
        # (split-K workspaces) reach their final size outside the graphs
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in self.buckets:
                for _ in range(2):
                    self._forward(bs)
        torch.cuda.current_stream().wait_stream(stream)
        for bs in reversed(self.buckets):  # largest first so smaller ones reuse its pool
            self._capture(bs)

    def _forward(self, bs: int) -> torch.Tensor:
        ids, pos, ctx = self.inputs[0, :bs], self.inputs[1, :bs], self.inputs[2, :bs]
        tables = list(self.tables[:, :bs].unbind(0))
        meta = AttentionMetadata(
            backend=self.backend,
            query_start_loc=self.query_start_loc[: bs + 1],
            context_lens=ctx,
            block_tables=tables,
            slot_mappings=[slot_mapping(t, self.seq_of[:bs], pos, self.block_size) for t in tables],
            block_size=self.block_size,
            max_query_len=1,
            max_context_len=self.max_model_len,
        )
        self.backend.prepare(meta)
        hidden = self.model.forward_cached(ids, pos, meta)
        return self.model.compute_logits(hidden)

    def _capture(self, bs: int) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bs] = self._forward(bs)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs] = graph

    def can_run(self, step: PackedStep) -> bool:
        return step.max_query_len == 1 and step.num_seqs <= self.buckets[-1]

    def run(self, step: PackedStep) -> torch.Tensor:
        b, w = step.num_seqs, step.table_width
        bs = next(x for x in self.buckets if x >= b)
        payload = step.payload
        self.inputs[:, :b].copy_(payload[: 3 * b].view(3, b))
        start = 5 * b + 1
        self.tables[:, :b, :w].copy_(
            payload[start : start + self.tables.shape[0] * b * w].view(-1, b, w)
        )
        if bs > b:
            self.inputs[:2, b:bs].zero_()
            self.inputs[2, b:bs].fill_(1)
            self.tables[:, b:bs, 0].zero_()
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
        graph_backend: AttentionBackend | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.block_size = kv_cache.block_size
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            if device.type != "cuda":
                raise ValueError("cuda_graphs=True needs a CUDA device")
            graph_backend = graph_backend or backend
            if not graph_backend.graph_capturable:
                raise ValueError(
                    f"the {graph_backend.name} attention backend cannot run in CUDA graphs"
                )
            with torch.inference_mode():
                self.graphs = DecodeGraphs(model, kv_cache, graph_backend, device, max_graph_batch)

    @torch.inference_mode()
    def run(self, step: PackedStep) -> torch.Tensor:
        """Logits [num_sample, vocab] (float32) of this step."""
        if self.graphs is not None and self.graphs.can_run(step):
            return self.graphs.run(step).float()
        parts = step.split()
        meta = build_metadata(step, parts, self.backend, self.block_size)
        self.backend.prepare(meta)
        hidden = self.model.forward_cached(parts["input_ids"], parts["positions"], meta)
        if not step.num_sample:  # only prefill chunks this step
            return hidden.new_empty(0, 0, dtype=torch.float32)
        rows = parts["sample_rows"].long()
        return self.model.compute_logits(hidden.index_select(0, rows)).float()

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Leader side: send the step to the other TP ranks, then run it."""
        step = pack(batch, self.block_size, self.kv_cache.max_model_len)
        payload = step.payload.to(self.device, non_blocking=True)
        if qdist.get_tp_size() > 1:
            header = torch.tensor(step.header(), dtype=torch.int32, device=self.device)
            qdist.broadcast(header)
            qdist.broadcast(payload)
        step.payload = payload
        return self.run(step)

    def worker_loop(self) -> None:
        """Non-leader TP ranks: run every step the leader broadcasts until it says stop."""
        header = torch.empty(HEADER_LEN, dtype=torch.int32, device=self.device)
        while True:
            qdist.broadcast(header)
            values = header.tolist()
            if values[0] == _STOP:
                return
            step = PackedStep.from_header(values, payload=header)
            payload = torch.empty(step.payload_len, dtype=torch.int32, device=self.device)
            qdist.broadcast(payload)
            step.payload = payload
            self.run(step)

    def stop_workers(self) -> None:
        if qdist.get_tp_size() > 1 and qdist.is_tp_leader():
            header = torch.zeros(HEADER_LEN, dtype=torch.int32, device=self.device)
            header[0] = _STOP
            qdist.broadcast(header)
