"""`quantfw serve` through the official openai client, plus raw HTTP for errors and metrics."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

API_KEY = "sk-test-key"  # the key the `server` fixture starts with

PROMPTS = [
    "hello world",
    "the quick brown fox",
    "tell me a story about a robot",
    "once upon a time there was a small village",
    "how are you today",
]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_plain_and_streaming_agree(client):
    kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens >= 1
    text = ""
    finish = None
    for chunk in client.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    assert text == full.choices[0].text
    assert finish == full.choices[0].finish_reason


def test_chat_plain_and_streaming_agree(client):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hello how are you"}],
        max_tokens=6,
        temperature=0,
    )
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    )
    assert text == full.choices[0].message.content


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=3,
        n=2,
        seed=5,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(r.choices) == 2
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)


def test_concurrent_requests_match_alone(client):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {'dog ' * (i % 4)}".strip() for i in range(20)]

    def ask(p: str) -> str:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
        return r.choices[0].text

    alone = {p: ask(p) for p in dict.fromkeys(prompts)}
    with cf.ThreadPoolExecutor(20) as pool:
        together = list(pool.map(ask, prompts))
    assert together == [alone[p] for p in prompts]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": "nope", "prompt": "hi"}, "model"),
        ({"model": "tiny", "prompt": "dog " * 400}, "prompt"),
        ({"model": "tiny"}, "prompt"),
    ],
)
def test_bad_requests_get_400(server, body, param):
    r = httpx.post(
        f"{server}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_openai_client_sees_400_and_server_stays_up(client, server):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=2
        )
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert r.choices[0].text is not None
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_api_key_required(server):
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics(server, client):
    client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    assert 'quantfw_requests_total{route="/v1/completions",status="200"}' in text
    assert "quantfw_generation_tokens_total" in text
    assert "quantfw_request_latency_seconds_count" in text
