"""A step as the runner executes it: one int32 tensor packing the step's token ids, positions,
context lengths, sequence of each token, query offsets, block tables and sampled rows (the
payload the leader broadcasts under tensor parallelism), and the attention metadata built from
it on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantfw.engine.scheduler import StepBatch
from quantfw.layers.attention import AttentionBackend, AttentionMetadata

#: the first value of a step header: a step follows, or the workers stop
STEP, STOP = 0, 1
HEADER_LEN = 9

#: every part of the payload (and each KV-cache group's block tables) starts at a multiple of
#: this many int32 values, 16 bytes: kernels given its slices see the same pointer alignment
#: every step, where Triton would compile a variant for each alignment it meets, mid-serving
ALIGN = 4


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


#: The SDPA backend reads the cache up to a multiple of this many positions (the mask hides the
#: rest), so eager steps see a new key length once per bucket instead of once per token:
#: attention libraries plan per shape (cuDNN SDPA on Hopper re-planned every decode step).
CONTEXT_BUCKET = 256


@dataclass
class PackedStep:
    """A step as the runner executes it: host ints + one int32 device tensor laid out as
    ``input_ids[T] positions[T] context_lens[B] seq_of[T] query_start_loc[B+1]
    block_tables[G][B][W] sample_rows[S]``, each part (and each group's tables) padded with
    zeros to a multiple of `ALIGN` values."""

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
            STEP, self.num_tokens, self.num_seqs, self.table_width, self.num_sample,
            self.max_query_len, self.max_context_len, self.num_groups, self.window,
        ]  # fmt: skip

    @classmethod
    def from_header(cls, header: list[int], payload: torch.Tensor) -> PackedStep:
        *sizes, window = header[1:]
        return cls(*sizes, payload=payload, window=window)

    def _layout(self) -> list[tuple[str, int]]:
        t, b, g = self.num_tokens, self.num_seqs, self.num_groups
        return [
            ("input_ids", t), ("positions", t), ("context_lens", b), ("seq_of", t),
            ("query_start_loc", b + 1), ("block_tables", g * _padded(b * self.table_width)),
            ("sample_rows", self.num_sample),
        ]  # fmt: skip

    def _offsets(self) -> dict[str, tuple[int, int]]:
        """Each part's (start, length) in the payload; its padded end is the next one's start."""
        offsets, start = {}, 0
        for name, n in self._layout():
            offsets[name] = (start, n)
            start += _padded(n)
        return offsets

    @property
    def payload_len(self) -> int:
        start, n = self._offsets()["sample_rows"]
        return start + _padded(n)

    def decode_inputs(self) -> torch.Tensor:
        """A decode step's input ids, positions and context lengths (one a sequence each: the
        payload's first three parts) as one [3, B] view."""
        if self.num_tokens != self.num_seqs:
            raise ValueError(f"not a decode step: {self.num_tokens} tokens, {self.num_seqs} seqs")
        n = _padded(self.num_seqs)
        return self.payload[: 3 * n].view(3, n)[:, : self.num_seqs]

    def _tables_at(self, start: int) -> torch.Tensor:
        b, w, g = self.num_seqs, self.table_width, self.num_groups
        tables = self.payload[start : start + g * _padded(b * w)].view(g, _padded(b * w))
        return tables[:, : b * w].view(g, b, w)

    def block_tables(self) -> torch.Tensor:
        """The block tables [G, B, W], a view without the groups' padding."""
        return self._tables_at(self._offsets()["block_tables"][0])

    def split(self) -> dict[str, torch.Tensor]:
        """The payload's parts, views without their padding (``block_tables`` [G, B, W])."""
        offsets = self._offsets()
        parts = {name: self.payload[start : start + n] for name, (start, n) in offsets.items()}
        parts["block_tables"] = self._tables_at(offsets["block_tables"][0])
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

    def part(values: list[int]) -> list[int]:
        return values + [0] * (_padded(len(values)) - len(values))

    tables: list[int] = []
    for g in range(groups):
        group: list[int] = []
        for row in batch.block_tables[g]:
            group.extend(row)
            group.extend([0] * (width - len(row)))
        tables.extend(part(group))
    values = (
        part(batch.input_ids) + part(batch.positions) + part(batch.context_lens)
        + part(seq_of) + part(starts) + tables + part(batch.sample_rows)
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


def attention_metadata(
    backend: AttentionBackend,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    tables: torch.Tensor,
    seq_of: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    max_query_len: int,
    max_context_len: int,
) -> AttentionMetadata:
    """A step's attention metadata (``tables`` [groups, B, cols]), each group's slot mapping
    computed on the device: from a step's payload (`build_metadata`) or a CUDA graph's static
    buffers (`cuda_graphs`)."""
    groups = list(tables.unbind(0))
    return AttentionMetadata(
        backend=backend,
        query_start_loc=query_start_loc,
        context_lens=context_lens,
        block_tables=groups,
        slot_mappings=[slot_mapping(t, seq_of, positions, block_size) for t in groups],
        block_size=block_size,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
    )


def build_metadata(
    step: PackedStep, parts: dict[str, torch.Tensor], backend: AttentionBackend, block_size: int
) -> AttentionMetadata:
    """`attention_metadata` of a step's payload parts (`PackedStep.split`)."""
    return attention_metadata(
        backend, parts["query_start_loc"], parts["context_lens"], parts["block_tables"],
        parts["seq_of"], parts["positions"], block_size, step.max_query_len,
        step.max_context_len,
    )  # fmt: skip
