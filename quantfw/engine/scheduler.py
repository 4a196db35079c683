"""Continuous batching over the paged KV cache: which sequences run in the next step, with how
many tokens.

Every step, running sequences that are decoding get one token each; sequences still prefilling,
then waiting ones, share the rest of the step's token budget, so a long prompt is prefilled in
chunks across steps while the others keep decoding. Blocks are allocated for exactly the tokens
a step computes. When a running sequence needs a block and none is free, the most recently
admitted running sequence is preempted: its blocks are freed and it goes back to the front of
the queue, to be recomputed (prompt and generated tokens) when blocks are free again. A waiting
sequence is admitted only when its first chunk's blocks are free; the engine refuses up front a
sequence that could not fit even alone, so every admitted sequence can finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from quantfw.engine.kv_cache import KVCache
from quantfw.engine.sequence import SeqStatus, Sequence


@dataclass
class StepBatch:
    """One forward step as plain data (what the other TP ranks receive).

    ``input_ids``/``positions`` are the flat new tokens; per sequence ``query_lens`` (new tokens)
    and ``context_lens`` (cached tokens after the step); ``block_tables[g][b]`` sequence b's
    table in KV-cache group g; ``sample_rows`` the flat rows whose logits are needed (one per
    sequence that completes its pending tokens this step).
    """

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[list[int]]]
    sample_rows: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class Scheduler:
    def __init__(self, kv_cache: KVCache, *, max_num_batched_tokens: int, max_num_seqs: int):
        self.kv_cache = kv_cache
        self.blocks = kv_cache.blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Allocate `seq`'s blocks for `n` more tokens, preempting the latest admitted running
        sequences while blocks are short. False when `seq` itself had to be preempted."""
        while not self.blocks.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq, n)
        return True

    def schedule_window(
        self, max_window: int, max_model_len: int, eligible: Callable[[Sequence], bool]
    ) -> tuple[list[tuple[Sequence, int]], StepBatch, int] | None:
        """A decode window: when nothing waits and every running sequence is decoding and
        `eligible` (plain greedy), up to `max_window` steps that the GPU runs back to back
        (blocks for all of them allocated now). None when an ordinary step is due."""
        if self.waiting or not self.running or max_window < 2:
            return None
        if not all(s.num_uncomputed == 1 and eligible(s) for s in self.running):
            return None
        room = min(
            min(s.params.max_tokens - len(s.output_token_ids), max_model_len - s.num_tokens)
            for s in self.running
        )
        window = min(max_window, room)
        if window < 2 or not self.blocks.can_allocate_all(self.running, window):
            return None
        for seq in self.running:
            self.blocks.allocate(seq, window)
        plan = [(s, 1) for s in self.running]
        return plan, self._batch(plan, lookahead=window), window

    def schedule(self) -> tuple[list[tuple[Sequence, int]], StepBatch] | None:
        """The (sequence, tokens) pairs of the next step and its batch; None when idle."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        preempted = False
        for seq in decoding + prefilling:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted for an earlier sequence of this step
            n = min(seq.num_uncomputed, budget)
            if n <= 0:
                break
            if not self._reserve(seq, n):
                preempted = True
                continue
            plan.append((seq, n))
            budget -= n
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.can_allocate(seq, n):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        plan = [(s, n) for s, n in plan if s.status is SeqStatus.RUNNING]
        if not plan:
            return None
        return plan, self._batch(plan)

    def _batch(self, plan: list[tuple[Sequence, int]], lookahead: int = 1) -> StepBatch:
        groups = self.blocks.num_groups
        batch = StepBatch([], [], [], [], [[] for _ in range(groups)], [])
        bs = self.blocks.block_size
        for seq, n in plan:
            start = seq.num_computed
            batch.input_ids.extend(seq.token_ids[start : start + n])
            batch.positions.extend(range(start, start + n))
            batch.query_lens.append(n)
            batch.context_lens.append(start + n)
            used = -(-(start + max(n, lookahead)) // bs)
            for g in range(groups):
                batch.block_tables[g].append(seq.block_tables[g][:used])
            if start + n == seq.num_tokens:
                batch.sample_rows.append(len(batch.input_ids) - 1)
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.blocks.free(seq)
