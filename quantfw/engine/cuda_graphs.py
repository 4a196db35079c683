"""CUDA graphs of the engine's steps: decode steps by batch-size bucket (`DecodeGraphs`) and
steps that prefill by token bucket (`PrefillGraphs`), each over static input buffers that a
step's inputs are copied into before its graph replays."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from quantfw.engine.kv_cache import KVCache
from quantfw.engine.step import PackedStep, attention_metadata
from quantfw.kernels.common.launch_mode import graph_launches
from quantfw.layers.attention import AttentionBackend


@contextmanager
def naming_the_way_out(graphs: str, switch: str) -> Iterator[None]:
    """Re-raise a failure while building `graphs` (a kernel that cannot be captured, memory)
    as a RuntimeError that names the `switch` which runs those steps eagerly instead."""
    try:
        yield
    except Exception as e:
        raise RuntimeError(
            f"building the {graphs} CUDA graphs failed ({type(e).__name__}: {e}); "
            f"{switch} runs those steps eagerly"
        ) from e


class StepGraphs:
    """One graph per bucket of a model's steps over `kv_cache` and `backend`; a subclass sets
    `buckets` and its buffers, then calls `_build`, and defines `_forward(bucket)`, the step it
    captures."""

    buckets: list[int]

    def __init__(self, model: nn.Module, kv_cache: KVCache, backend: AttentionBackend):
        self.model = model
        self.backend = backend
        self.block_size = kv_cache.block_size
        self.max_model_len = kv_cache.max_model_len
        #: block-table columns of a sequence of max_model_len tokens
        self.table_cols = -(-self.max_model_len // self.block_size)

    def _build(self, pool=None) -> None:
        """Run every bucket twice, then capture each, largest first, into `pool` (None: a new
        one, which smaller graphs then reuse). Every bucket runs before any is captured, so that
        buffers kernels grow on first use (split-K workspaces) reach their final size outside
        the graphs; the calls are marked as made for graphs (`graph_launches`: kernels may pick
        launches that are cheap on the GPU but not on the host)."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool
        with graph_launches():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for bucket in self.buckets:
                    for _ in range(2):
                        self._warm_up(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            for bucket in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[bucket] = self._forward(bucket)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bucket] = graph

    def _warm_up(self, bucket: int) -> None:
        self._forward(bucket)

    def _forward(self, bucket: int) -> torch.Tensor:
        raise NotImplementedError

    def bucket_for(self, n: int) -> int:
        """The smallest bucket holding `n` rows."""
        return next(b for b in self.buckets if b >= n)


class DecodeGraphs(StepGraphs):
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
        pool=None,
    ):
        super().__init__(model, kv_cache, backend)
        self.max_window = max(1, max_window)
        self.buckets = sorted({min(2**i, max_bs) for i in range(max_bs.bit_length() + 1)})
        n, cols = self.buckets[-1], self.table_cols
        # rows: input_ids, positions, context_lens (the payload's first 3 * B values for decode),
        # and 1 for real rows / 0 for padding
        self.inputs = torch.zeros(4, n, dtype=torch.int32, device=device)
        self.inputs[2].fill_(1)
        self.tables = torch.zeros(len(kv_cache.groups), n, cols, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_of = torch.arange(n, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(self.max_window, n, dtype=torch.int32, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self._build(pool)

    def _warm_up(self, bucket: int) -> None:
        self.step_index.zero_()
        self._forward(bucket)

    def _forward(self, bs: int) -> torch.Tensor:
        ids, pos, ctx, active = self.inputs[:, :bs].unbind(0)
        meta = attention_metadata(
            self.backend, self.query_start_loc[: bs + 1], ctx, self.tables[:, :bs],
            self.seq_of[:bs], pos, self.block_size, 1, self.max_model_len,
        )  # fmt: skip
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

    def can_run(self, step: PackedStep) -> bool:
        return step.max_query_len == 1 and step.num_seqs <= self.buckets[-1]

    def _load(self, step: PackedStep) -> int:
        """Copy the step's inputs into the static buffers; returns the bucket."""
        b, w = step.num_seqs, step.table_width
        bs = self.bucket_for(b)
        self.inputs[:3, :b].copy_(step.decode_inputs())
        self.tables[:, :b, :w].copy_(step.block_tables())
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

    def run_window(self, step: PackedStep, stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Up to `step.window` decode steps back to back; the greedy tokens [steps run, B]
        (device). With `stop`, at most two steps are queued on the GPU at a time and, before
        each further one, a True from `stop` ends the window there (at least two steps run)."""
        if not 1 <= step.window <= self.max_window:
            raise ValueError(f"decode window {step.window} outside 1..{self.max_window}")
        bs = self._load(step)
        done: list[torch.cuda.Event] = []
        steps = step.window
        for i in range(step.window):
            if stop is not None and i >= 2:
                done[i - 2].synchronize()  # step i - 1 still queued: the GPU does not idle
                if stop():
                    steps = i
                    break
            self.graphs[bs].replay()
            if stop is not None:
                done.append(torch.cuda.Event())
                done[-1].record()
        return self.tokens[:steps, : step.num_seqs]


#: the smallest prefill bucket (steps of 2..16 tokens share it)
MIN_PREFILL_BUCKET = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets of `PrefillGraphs` up to `max_tokens`: powers of two from 16 and the
    midpoints 1.5x between them (a step of more than 16 tokens runs under 1.5x its rows), and
    `max_tokens` itself."""
    if max_tokens < MIN_PREFILL_BUCKET:
        raise ValueError(
            f"prefill graphs need max_tokens >= {MIN_PREFILL_BUCKET} (0 turns them off), "
            f"got {max_tokens}"
        )
    buckets = {max_tokens}
    size = MIN_PREFILL_BUCKET
    while size < max_tokens:
        buckets.update(b for b in (size, size + size // 2) if b < max_tokens)
        size *= 2
    return sorted(buckets)


def resolve_prefill_graph_tokens(
    requested: int | None,
    default: int,
    *,
    graph_backend: AttentionBackend | None,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> int:
    """The most tokens a prefill step replayed as a graph may hold (0: none). `graph_backend`:
    the attention backend of the CUDA graphs (None: no graphs). None asks for `default`,
    capped at what a step can hold (max_num_batched_tokens, max_model_len), and 0 without
    graphs, with a backend whose prefill cannot be captured, or below `MIN_PREFILL_BUCKET`;
    an explicit value must fit those bounds (the padding rows' positions stay inside the
    context and its block tables)."""
    cap = min(max_num_batched_tokens, max_model_len)
    capturable = graph_backend is not None and graph_backend.prefill_graph_capturable
    if requested is None:
        tokens = min(default, cap)
        return tokens if capturable and tokens >= MIN_PREFILL_BUCKET else 0
    if requested and not (capturable and MIN_PREFILL_BUCKET <= requested <= cap):
        backend = "no CUDA graphs" if graph_backend is None else f"{graph_backend.name} graphs"
        raise ValueError(
            f"prefill_graph_tokens={requested} must be 0 (no prefill graphs) or "
            f"{MIN_PREFILL_BUCKET}..{cap} (max_num_batched_tokens {max_num_batched_tokens}, "
            f"max_model_len {max_model_len}), with CUDA graphs whose attention backend "
            f"captures prefill (triton; this engine: {backend})"
        )
    return requested


class PrefillGraphs(StepGraphs):
    """CUDA graphs of the steps that prefill (prompts, chunks of long ones after their cached
    context, beside the decoding sequences of the batch) of up to `max_tokens` tokens in up to
    `max_seqs` sequences, one per token bucket (`prefill_buckets`): eagerly such a step's
    hundreds of kernel launches take longer on the host than on the GPU.

    A step of T tokens in B sequences replays the graph of the smallest bucket >= T over
    ``max_seqs + 1`` sequence slots: its sequences fill the first B slots, the others up to
    ``max_seqs`` are empty (no rows), and the last slot takes the bucket's T.. rows as a
    padding sequence in the null block (positions 0.., a block table of zeros), which stores
    its keys and values there and attends only to what it stored; so the step's sequences'
    cache and attention are untouched (only block 0, which no sequence reads, takes its
    writes). The graph computes the logits of ``max_seqs`` sampled rows, of which the step's
    first S are its own."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        max_tokens: int,
        max_seqs: int,
        pool=None,
    ):
        super().__init__(model, kv_cache, backend)
        if max_tokens > self.max_model_len:
            raise ValueError(
                f"prefill graphs of {max_tokens} tokens exceed max_model_len "
                f"({self.max_model_len}): the padding rows' positions must fit the context"
            )
        self.buckets = prefill_buckets(max_tokens)
        self.max_seqs = max_seqs
        n, slots = self.buckets[-1], max_seqs + 1
        # rows: input ids, positions, the sequence slot of each row (the last slot: padding)
        self.rows = torch.zeros(3, n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(slots, dtype=torch.int32, device=device)
        self.tables = torch.zeros(
            len(kv_cache.groups), slots, self.table_cols, dtype=torch.int32, device=device
        )
        self.sample_rows = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self._arange = torch.arange(n, dtype=torch.int32, device=device)
        self._build(pool)

    def _warm_up(self, bucket: int) -> None:
        self._pad(0, 0, bucket)  # a step of padding only
        self.sample_rows.zero_()
        self._forward(bucket)

    def _forward(self, bucket: int) -> torch.Tensor:
        ids, pos, seq_of = self.rows[:, :bucket].unbind(0)
        meta = attention_metadata(
            self.backend, self.query_start_loc, self.context_lens, self.tables, seq_of, pos,
            self.block_size, bucket, self.max_model_len,
        )  # fmt: skip
        self.backend.prepare(meta)
        hidden = self.model.forward_cached(ids, pos, meta)
        return self.model.compute_logits(hidden.index_select(0, self.sample_rows))

    def can_run(self, step: PackedStep) -> bool:
        """A step of 2..max_tokens tokens in at most max_seqs sequences, one of them
        prefilling (decode-only steps take `DecodeGraphs`), sampling at most max_seqs rows."""
        return (
            step.max_query_len > 1
            and step.num_tokens <= self.buckets[-1]
            and step.num_seqs <= self.max_seqs
            and step.num_sample <= self.max_seqs
            and step.window == 1
        )

    def _pad(self, tokens: int, seqs: int, bucket: int) -> None:
        """Slots ``seqs .. max_seqs`` empty, the last one the padding sequence: rows ``tokens ..
        bucket``, token 0 at positions 0.. (slot max_seqs has a block table of zeros)."""
        pad, last = bucket - tokens, self.max_seqs
        self.rows[0, tokens:bucket].zero_()
        self.rows[1, tokens:bucket].copy_(self._arange[:pad])
        self.rows[2, tokens:bucket].fill_(last)
        self.query_start_loc[seqs + 1 : last + 1].fill_(tokens)  # empty: no rows, no keys read
        self.query_start_loc[last + 1].fill_(bucket)
        self.context_lens[last].fill_(pad)

    def _load(self, step: PackedStep) -> int:
        """Copy the step's inputs into the static buffers; returns the bucket."""
        t, b, w, s = step.num_tokens, step.num_seqs, step.table_width, step.num_sample
        bucket = self.bucket_for(t)
        parts = step.split()
        self.rows[0, :t].copy_(parts["input_ids"])
        self.rows[1, :t].copy_(parts["positions"])
        self.rows[2, :t].copy_(parts["seq_of"])
        self.query_start_loc[: b + 1].copy_(parts["query_start_loc"])
        self.context_lens[:b].copy_(parts["context_lens"])
        self.tables[:, :b, :w].copy_(parts["block_tables"])
        self.sample_rows[:s].copy_(parts["sample_rows"])
        self.sample_rows[s:].zero_()  # rows inside every bucket
        self._pad(t, b, bucket)
        return bucket

    def run(self, step: PackedStep) -> torch.Tensor:
        """Logits [num_sample, vocab] of the step's sampled rows."""
        bucket = self._load(step)
        self.graphs[bucket].replay()
        return self.outputs[bucket][: step.num_sample]
