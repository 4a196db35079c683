"""The paged KV cache and its scheduler: blocks allocated as sequences grow and freed when they
end, preemption when blocks run out (recompute, never corrupting another sequence), clean refusal
of what can never fit, sliding-window groups keeping only the window's blocks."""

from __future__ import annotations

import pytest
from tiny_checkpoint import hf_greedy

from quantfw.engine import LLMEngine, SamplingParams
from quantfw.engine.block_manager import BlockManager
from quantfw.engine.sequence import Sequence
from quantfw.layers.attention import NULL_BLOCK

PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [1, 30, 31]]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def run_all(engine: LLMEngine, prompts) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done: dict[str, list[int]] = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def test_blocks_grow_with_the_sequence_and_return_at_the_end(tiny_llama):
    engine = LLMEngine(tiny_llama, max_num_seqs=4, block_size=4, max_model_len=64)
    start = engine.kv_cache.num_free
    assert start == engine.kv_cache.initial_free
    engine.add_request(PROMPTS[1], GREEDY)
    engine.step()  # prefill of 11 tokens: 3 blocks of 4
    seq = engine.scheduler.running[0]
    assert len(seq.block_tables[0]) == 3 and engine.kv_cache.num_free == start - 3
    assert NULL_BLOCK not in seq.block_tables[0]
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_cache.num_free == start


def test_preemption_keeps_greedy_tokens(tiny_llama):
    # 3 sequences growing to 23 tokens each need 3 x 6 blocks of 4; 10 usable blocks force
    # the latest admitted ones out and back in (recomputed) while the others go on
    reference = hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
    engine = LLMEngine(
        tiny_llama, max_num_seqs=3, block_size=4, max_model_len=32, num_gpu_blocks=11
    )
    assert run_all(engine, PROMPTS) == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.num_free == engine.kv_cache.initial_free


def test_abort_frees_blocks_at_once(tiny_llama):
    engine = LLMEngine(tiny_llama, max_num_seqs=2, block_size=4, max_model_len=64)
    rid = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    assert engine.kv_cache.num_free < engine.kv_cache.initial_free
    engine.abort(rid)
    assert engine.kv_cache.num_free == engine.kv_cache.initial_free


def test_cache_smaller_than_one_sequence_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="not enough memory for the KV cache"):
        LLMEngine(tiny_llama, block_size=4, max_model_len=64, num_gpu_blocks=8)
    engine = LLMEngine(tiny_llama, block_size=4, max_model_len=16, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(1, 17)), GREEDY)


def _seq(n_tokens: int) -> Sequence:
    return Sequence("r", 0, list(range(n_tokens)), GREEDY)


def test_sliding_window_group_keeps_only_the_window():
    manager = BlockManager(4, [None, 6], [40, 40])
    seq = _seq(30)
    manager.allocate(seq, 30)  # prefill: every block of both groups
    assert len(seq.block_tables[0]) == len(seq.block_tables[1]) == 8
    seq.num_computed = 30
    free_before = manager.pools[1].num_free
    manager.allocate(seq, 1)  # the query at 30 sees keys 25..30: blocks 6 and 7 only
    window_table = seq.block_tables[1]
    assert window_table[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in window_table[6:]
    assert manager.pools[1].num_free == free_before + 6
    assert NULL_BLOCK not in seq.block_tables[0]
    manager.free(seq)
    assert manager.pools[0].num_free == manager.pools[1].num_free == 39


def test_can_allocate_counts_the_blocks_a_window_releases():
    manager = BlockManager(4, [8], [4])  # 3 usable blocks
    seq = _seq(12)
    manager.allocate(seq, 12)
    seq.num_computed = 12
    assert manager.pools[0].num_free == 0
    # 4 more tokens need block 3; the query at 12 no longer sees block 0 (tokens 0..3)
    assert manager.can_allocate(seq, 4)
    manager.allocate(seq, 4)
    assert seq.block_tables[0][0] == NULL_BLOCK and len(seq.block_tables[0]) == 4
