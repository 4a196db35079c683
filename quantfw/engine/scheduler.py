"""Continuous batching: which sequences run in the next step, and with how many tokens.

Every step, running sequences that are decoding get one token each; sequences still prefilling
and then waiting ones (given a cache slot as they are admitted) share the rest of the step's
token budget, so a long prompt is prefilled in chunks across several steps while the others
keep decoding. New requests join between any two steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from quantfw.engine.kv_cache import KVCache
from quantfw.engine.sequence import SeqStatus, Sequence


@dataclass
class StepBatch:
    """One forward step as plain data (picklable: broadcast to the other TP ranks).

    ``input_ids``/``positions`` are the flat tokens; per sequence: ``slots``, ``query_lens``,
    ``context_lens`` (cached tokens after the step); ``sample_rows`` the flat rows whose logits
    are needed (one per sequence that completes its pending tokens this step).
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    context_lens: list[int]
    sample_rows: list[int]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class Scheduler:
    def __init__(self, kv_cache: KVCache, *, max_num_batched_tokens: int):
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[tuple[Sequence, int]], StepBatch] | None:
        """The (sequence, tokens) pairs of the next step and its batch; None when idle."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decoding:
            plan.append((seq, 1))
            budget -= 1
        for seq in prefilling:
            if budget <= 0:
                break
            n = min(seq.num_uncomputed, budget)
            plan.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and self.kv_cache.num_free > 0:
            seq = self.waiting.popleft()
            seq.slot = self.kv_cache.allocate()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            plan.append((seq, n))
            budget -= n
        if not plan:
            return None
        return plan, self._batch(plan)

    @staticmethod
    def _batch(plan: list[tuple[Sequence, int]]) -> StepBatch:
        batch = StepBatch([], [], [], [], [], [])
        for seq, n in plan:
            start = seq.num_computed
            tokens = seq.token_ids[start : start + n]
            batch.input_ids.extend(tokens)
            batch.positions.extend(range(start, start + n))
            batch.slots.append(seq.slot)
            batch.query_lens.append(n)
            batch.context_lens.append(start + n)
            if start + n == seq.num_tokens:
                batch.sample_rows.append(len(batch.input_ids) - 1)
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.kv_cache.release(seq.slot)
            seq.slot = -1
        elif seq in self.waiting:
            self.waiting.remove(seq)
