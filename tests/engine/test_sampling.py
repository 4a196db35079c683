"""SamplingParams: validation, penalties and filters, seeds, n, stops, logprobs."""

from __future__ import annotations

import pytest
import torch

from quantfw.engine import LLM, SamplingParams
from quantfw.engine.sampler import apply_penalties, filter_logits

PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13], [1, 30, 31]]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, max_num_seqs=4)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**kwargs)


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    freq = apply_penalties(
        logits, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), [2], [3, 3]
    )
    assert freq.tolist() == [2.0, -2.0, 1.0, 0.5 - 1.0 - 1.0]


def test_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda p: torch.isfinite(filter_logits(logits, p)).tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.7)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.1)) == [True, False, False, False]
    assert kept(SamplingParams(min_p=0.5)) == [True, True, False, False]


def test_seed_is_reproducible_per_request(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=123, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
    batched = llm.generate(
        PROMPTS, [sp, SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True), sp]
    )
    assert batched[0].outputs[0].token_ids == alone
    other = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=8, seed=7))
    assert other[0].outputs[0].token_ids != alone


def test_n_completions(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, max_tokens=6, seed=1, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_token_ids_and_strings(llm):
    greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    stop_id = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_id)
    out = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    word = greedy.text.split()[2]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, stop=[word]))[0]
    assert out.outputs[0].text == greedy.text[: greedy.text.index(word)]
    assert out.outputs[0].finish_reason == "stop"
    assert greedy.finish_reason == "length"


def test_logprobs(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.logprob == pytest.approx(max(lp.top.values()))


def test_chat_and_prompt_length_errors(llm):
    out = llm.chat([{"role": "user", "content": "hello world"}], SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) <= 3
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 300], SamplingParams(max_tokens=2))
