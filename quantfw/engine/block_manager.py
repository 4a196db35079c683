"""Hands out KV-cache blocks to sequences: one block table per KV-cache group.

A group is a set of attention layers with the same span: full attention, or one sliding window.
Its blocks form a pool of ids ``1 .. num_blocks - 1`` (block 0 is the null block). Before a step
that computes a sequence's tokens ``[c, c + n)``, the sequence's table in every group is extended
to cover ``c + n`` tokens; in a sliding-window group the blocks every query of the step (and of
later steps) can no longer see, those holding only tokens ``< c - window + 1``, are returned to
the pool first and their table entries point at the null block.
"""

from __future__ import annotations

from quantfw.engine.sequence import Sequence
from quantfw.layers.attention.metadata import NULL_BLOCK


class BlockPool:
    """Free block ids of one group (lowest id first)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a KV-cache group needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() gives the lowest

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV-cache blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(b for b in reversed(blocks) if b != NULL_BLOCK)


class BlockManager:
    def __init__(self, block_size: int, windows: list[int | None], num_blocks: list[int]):
        if len(windows) != len(num_blocks):
            raise ValueError("one block count per KV-cache group is needed")
        self.block_size = block_size
        self.windows = list(windows)
        self.pools = [BlockPool(n) for n in num_blocks]

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    @property
    def num_free(self) -> int:
        """Free blocks over all groups."""
        return sum(p.num_free for p in self.pools)

    def _first_visible_block(self, group: int, computed: int) -> int:
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, computed - window + 1) // self.block_size

    def _plan(self, seq: Sequence, group: int, new_tokens: int) -> tuple[int, list[int]]:
        """(blocks to take, logical indices to release) for computing `new_tokens` more."""
        table = seq.block_tables[group] if seq.block_tables else []
        total = -(-(seq.num_computed + new_tokens) // self.block_size)
        first = self._first_visible_block(group, seq.num_computed)
        release = [i for i in range(min(first, len(table))) if table[i] != NULL_BLOCK]
        take = max(0, total - len(table))
        return take, release

    def can_allocate(self, seq: Sequence, new_tokens: int) -> bool:
        for group, pool in enumerate(self.pools):
            take, release = self._plan(seq, group, new_tokens)
            if take > pool.num_free + len(release):
                return False
        return True

    def can_allocate_all(self, seqs: list[Sequence], new_tokens: int) -> bool:
        """Whether every one of `seqs` can get blocks for `new_tokens` more tokens at once."""
        for group, pool in enumerate(self.pools):
            net = 0
            for seq in seqs:
                take, release = self._plan(seq, group, new_tokens)
                net += take - len(release)
            if net > pool.num_free:
                return False
        return True

    def allocate(self, seq: Sequence, new_tokens: int) -> None:
        """Extend `seq`'s tables to hold ``num_computed + new_tokens`` tokens (check
        `can_allocate` first)."""
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.pools]
        for group, pool in enumerate(self.pools):
            take, release = self._plan(seq, group, new_tokens)
            table = seq.block_tables[group]
            pool.give_back([table[i] for i in release])
            for i in release:
                table[i] = NULL_BLOCK
            table.extend(pool.take(take))

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks."""
        for group, pool in enumerate(self.pools):
            if seq.block_tables:
                pool.give_back(seq.block_tables[group])
        seq.block_tables = []
