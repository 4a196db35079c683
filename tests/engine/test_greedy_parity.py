"""Greedy generation through the KV-cache engine equals transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoint import hf_greedy

from quantfw.engine import LLM, LLMEngine, SamplingParams

PROMPTS = [
    [1, 5, 6, 7],
    [1, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26],
    [1, 30],
    [1, 40, 41, 42, 43, 44, 45],
    [1, 50, 51, 52, 53, 54],
]
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_batch_with_chunked_prefill_matches_transformers(arch, request):
    path = request.getfixturevalue(arch)
    # 3 slots for 5 prompts: two requests join while the others decode; a budget of 8 tokens
    # per step splits the 19-token prompt into chunks.
    llm = LLM(path, max_num_seqs=3, max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS, GREEDY)
    ref = hf_greedy(path, PROMPTS, MAX_NEW)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_requests_joining_mid_decode_match(tiny_llama):
    engine = LLMEngine(tiny_llama, max_num_seqs=8)
    results: dict[str, list[int]] = {}
    order = {}
    for i, p in enumerate(PROMPTS[:2]):
        order[engine.add_request(p, GREEDY)] = i
    joined = False
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 4 and not joined:  # the first two are decoding by now
            for i, p in enumerate(PROMPTS[2:], start=2):
                order[engine.add_request(p, GREEDY)] = i
            joined = True
        assert steps < 200
    got = [results[rid] for rid, _ in sorted(order.items(), key=lambda kv: kv[1])]
    assert got == hf_greedy(tiny_llama, PROMPTS, MAX_NEW)


def test_cache_free_forward_still_works(tiny_llama):
    llm = LLM(tiny_llama, max_num_seqs=2)
    model = llm.engine.model
    ids = torch.tensor([PROMPTS[0], PROMPTS[4][:4]])
    logits = model(ids)
    assert logits.shape == (2, 4, 128)


def _reference_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy by full recomputation through quantfw's cache-free model(input_ids)."""
    from quantfw import load_model

    model = load_model(path, dtype="float32")
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
                if ids[-1] == 2:
                    break
            outs.append(ids[len(p) :])
    return outs


def test_awq_greedy_matches_cache_free(tiny_llama, tmp_path):
    exporter = pytest.importorskip("quantfw.exporter")
    awq = exporter.quantize_checkpoint(
        tiny_llama, str(tmp_path / "awq"), method="awq", group_size=32
    )
    llm = LLM(awq, dtype="float32", max_num_seqs=2, max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == _reference_greedy(awq, PROMPTS, MAX_NEW)


def test_generate_raises_when_a_request_fails(tiny_llama, monkeypatch):
    """A request that fails inside the engine (here: its sampling raises) is an error of
    `LLM.generate`, naming the request, not an output that looks finished."""
    from quantfw.engine import engine as engine_module

    llm = LLM(tiny_llama, max_num_seqs=2)

    def broken(*args, **kwargs):
        raise ValueError("sampling broke")

    monkeypatch.setattr(engine_module, "sample", broken)
    with pytest.raises(RuntimeError, match="1 of 1 requests failed.*sampling broke"):
        llm.generate([PROMPTS[0]], GREEDY)
