"""`engine.step.pack`: the step's parts come back from the payload unchanged, each starting 16
bytes aligned (kernels given the slices see one pointer alignment every step, so Triton does
not compile variants mid-serving), and a decode step's first three parts as one view."""

from __future__ import annotations

import random

import pytest

from quantfw.engine.scheduler import StepBatch
from quantfw.engine.step import PackedStep, pack


def _batch(rng: random.Random, seqs: int, groups: int, decode: bool) -> StepBatch:
    query = [1 if decode else rng.randint(1, 9) for _ in range(seqs)]
    context = [q + rng.randint(0, 40) for q in query]
    ids = [rng.randint(1, 999) for _ in range(sum(query))]
    positions = [c - q + j for q, c in zip(query, context) for j in range(q)]
    tables = [[[rng.randint(1, 500) for _ in range(-(-c // 16))] for c in context]
              for _ in range(groups)]  # fmt: skip
    sample = sorted(rng.sample(range(sum(query)), rng.randint(0, min(seqs, sum(query)))))
    return StepBatch(ids, positions, query, context, tables, sample)


@pytest.mark.parametrize("decode", [False, True])
def test_parts_round_trip_aligned(decode):
    rng = random.Random(int(decode))
    for seqs in range(1, 12):
        for groups in (1, 2):
            batch = _batch(rng, seqs, groups, decode)
            step = pack(batch, block_size=16, max_model_len=4096)
            step.payload = step.payload.clone()  # a fresh allocation: its base is aligned
            assert step.payload.numel() == step.payload_len
            parts = step.split()
            starts = [0]
            for n in batch.query_lens:
                starts.append(starts[-1] + n)
            seq_of = [i for i, n in enumerate(batch.query_lens) for _ in range(n)]
            want = {
                "input_ids": batch.input_ids, "positions": batch.positions,
                "context_lens": batch.context_lens, "seq_of": seq_of, "query_start_loc": starts,
                "sample_rows": batch.sample_rows,
            }  # fmt: skip
            for name, values in want.items():
                assert parts[name].tolist() == values, name
                assert parts[name].data_ptr() % 16 == 0, (name, seqs, groups)
            tables = parts["block_tables"]
            assert tables.shape == (groups, seqs, step.table_width)
            for g in range(groups):
                assert tables[g].data_ptr() % 16 == 0, (g, seqs)
                for b, row in enumerate(batch.block_tables[g]):
                    assert tables[g, b, : len(row)].tolist() == row
                    assert not tables[g, b, len(row) :].any()
            if decode:
                assert step.decode_inputs().tolist() == [
                    batch.input_ids,
                    batch.positions,
                    batch.context_lens,
                ]
            elif step.num_tokens != step.num_seqs:
                with pytest.raises(ValueError, match="not a decode step"):
                    step.decode_inputs()
            header = PackedStep.from_header(step.header(), step.payload)
            assert header.payload_len == step.payload_len
