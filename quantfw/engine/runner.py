"""Runs one `StepBatch` through the model: packs it into one int32 tensor, builds the attention
metadata on the device, calls the cache-aware forward, returns the logits of the rows to sample.
Decode steps replay CUDA graphs when enabled.

Decode windows: for a batch of plain greedy sequences the engine may run `window` decode steps
back to back: each captured step ends by taking the argmax of its logits, writing it as the next
step's input token and advancing positions and context lengths, so the GPU runs the window
without waiting for the host; the host reads the window's tokens once at the end.

Under tensor parallelism the leader broadcasts each step as two tensors (a 9-int header, then
the packed payload) and the other ranks sit in `worker_loop`, running exactly the same steps
from the same tensors (in a window, every rank takes the argmax of the same all-gathered
logits); only the leader samples. No Python object is pickled per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantfw import distributed as qdist
from quantfw.engine.kv_cache import KVCache
from quantfw.engine.scheduler import StepBatch
from quantfw.kernels.common.launch_mode import graph_launches
from quantfw.layers.attention import AttentionBackend, AttentionMetadata

_STEP, _STOP = 0, 1
HEADER_LEN = 9

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
    #: decode steps run back to back (greedy feedback on the device); 1: one ordinary step
    window: int = 1

    def header(self) -> list[int]:
        return [
            _STEP, self.num_tokens, self.num_seqs, self.table_width, self.num_sample,
            self.max_query_len, self.max_context_len, self.num_groups, self.window,
        ]  # fmt: skip

    @classmethod
    def from_header(cls, header: list[int], payload: torch.Tensor) -> PackedStep:
        *sizes, window = header[1:]
        return cls(*sizes, payload=payload, window=window)

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


def pack(batch: StepBatch, block_size: int, max_model_len: int, window: int = 1) -> PackedStep:
    b, groups = batch.num_seqs, len(batch.block_tables)
    max_ctx = max(batch.context_lens)
    width = table_width(max_ctx + window - 1, block_size, max_model_len)
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
        groups, payload, window,
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
    and write there. Every step ends with the greedy feedback of a decode window: the argmax
    of each row becomes the next input token, stored in `tokens` [max_window, bucket] at row
    `step_index`, and real rows advance their position and context length by one.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        max_bs: int,
        max_window: int = 1,
    ):
        self.model = model
        self.backend = backend
        self.block_size = kv_cache.block_size
        self.max_model_len = kv_cache.max_model_len
        self.max_window = max(1, max_window)
        self.buckets = sorted({min(2**i, max_bs) for i in range(max_bs.bit_length() + 1)})
        n = self.buckets[-1]
        cols = -(-self.max_model_len // self.block_size)
        # rows: input_ids, positions, context_lens (the payload's first 3 * B values for decode),
        # and 1 for real rows / 0 for padding
        self.inputs = torch.zeros(4, n, dtype=torch.int32, device=device)
        self.inputs[2].fill_(1)
        self.tables = torch.zeros(len(kv_cache.groups), n, cols, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_of = torch.arange(n, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(self.max_window, n, dtype=torch.int32, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        # run every bucket before capturing any, so that buffers kernels grow on first use
        # (split-K workspaces) reach their final size outside the graphs
        # (kernels may pick launches that are cheap on the GPU but not on the host: replayed)
        with graph_launches():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for bs in self.buckets:
                    for _ in range(2):
                        self.step_index.zero_()
                        self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            for bs in reversed(self.buckets):  # largest first so smaller ones reuse its pool
                self._capture(bs)

    def _forward(self, bs: int) -> torch.Tensor:
        ids, pos, ctx, active = self.inputs[:, :bs].unbind(0)
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
        logits = self.model.compute_logits(hidden)
        # greedy feedback (read by decode windows; ordinary steps rewrite the inputs)
        nxt = logits.argmax(-1).to(torch.int32)
        ids.copy_(nxt)
        pos.add_(active)
        ctx.add_(active)
        self.tokens[:, :bs].index_copy_(0, self.step_index, nxt.view(1, bs))
        self.step_index.add_(1)
        return logits

    def _capture(self, bs: int) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bs] = self._forward(bs)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs] = graph

    def can_run(self, step: PackedStep) -> bool:
        return step.max_query_len == 1 and step.num_seqs <= self.buckets[-1]

    def _load(self, step: PackedStep) -> int:
        """Copy the step's inputs into the static buffers; returns the bucket."""
        b, w = step.num_seqs, step.table_width
        bs = next(x for x in self.buckets if x >= b)
        payload = step.payload
        self.inputs[:3, :b].copy_(payload[: 3 * b].view(3, b))
        start = 5 * b + 1
        groups = self.tables.shape[0]
        self.tables[:, :b, :w].copy_(payload[start : start + groups * b * w].view(groups, b, w))
        self.inputs[3, :b].fill_(1)
        if bs > b:
            self.inputs[:2, b:bs].zero_()
            self.inputs[2, b:bs].fill_(1)
            self.inputs[3, b:bs].zero_()
            self.tables[:, b:bs, 0].zero_()
        self.step_index.zero_()
        return bs

    def run(self, step: PackedStep) -> torch.Tensor:
        """Logits [B, vocab] of one decode step."""
        bs = self._load(step)
        self.graphs[bs].replay()
        return self.outputs[bs][: step.num_seqs]

    def run_window(self, step: PackedStep) -> torch.Tensor:
        """`step.window` decode steps back to back; the greedy tokens [window, B] (device)."""
        if not 1 <= step.window <= self.max_window:
            raise ValueError(f"decode window {step.window} outside 1..{self.max_window}")
        bs = self._load(step)
        for _ in range(step.window):
            self.graphs[bs].replay()
        return self.tokens[: step.window, : step.num_seqs]


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
        max_window: int = 1,
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
                self.graphs = DecodeGraphs(
                    model, kv_cache, graph_backend, device, max_graph_batch, max_window
                )
            qdist.on_teardown(self.release_graphs)

    def release_graphs(self) -> None:
        """Drop the decode CUDA graphs, at teardown (`distributed.destroy_distributed`: graphs
        that captured NCCL collectives must be gone before the process group is); the engine
        is not stepped after it (its decode windows need the graphs)."""
        self.graphs = None

    @property
    def max_window(self) -> int:
        """The longest decode window the graphs can run (1: none)."""
        return self.graphs.max_window if self.graphs is not None else 1

    @torch.inference_mode()
    def run(self, step: PackedStep) -> torch.Tensor:
        """Logits [num_sample, vocab] (float32) of this step; for a decode window, its greedy
        tokens [window, B] (int32)."""
        if step.window > 1:
            if self.graphs is None or not self.graphs.can_run(step):
                raise ValueError("a decode window needs the CUDA graphs of its batch size")
            return self.graphs.run_window(step)
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

    def execute(self, batch: StepBatch, window: int = 1) -> torch.Tensor:
        """Leader side: send the step to the other TP ranks, then run it."""
        step = pack(batch, self.block_size, self.kv_cache.max_model_len, window)
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
