"""`quantfw serve` through the official openai client (sync and async): every call pattern,
streamed and not, completions and chat, n = 1 and 2, with and without include_usage; greedy
text against transformers; the request surface (honoured, or a 400 naming the field)."""

from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import torch  # noqa: E402
from tiny_checkpoint import hf_greedy  # noqa: E402

API_KEY = "sk-test-key"  # the key the `server` fixture starts with
MAX_MODEL_LEN = 256  # the tiny model's max_position_embeddings
PROMPT = "tell me a story about a robot who"
MESSAGES = [{"role": "user", "content": "hello how are you"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def call(server: str, kind: str, route: str, **kw):
    """One call through the sync or the async client: the response, or the list of chunks."""
    base = dict(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    if kind == "sync":
        c = openai.OpenAI(**base)
        create = c.completions.create if route == "completions" else c.chat.completions.create
        r = create(**kw)
        return list(r) if kw.get("stream") else r

    async def run():
        async with openai.AsyncOpenAI(**base) as c:
            create = c.completions.create if route == "completions" else c.chat.completions.create
            r = await create(**kw)
            return [x async for x in r] if kw.get("stream") else r

    return asyncio.run(run())


def choice_texts(route: str, response) -> list[str]:
    choices = sorted(response.choices, key=lambda c: c.index)
    return [c.text if route == "completions" else c.message.content for c in choices]


def route_kwargs(route: str) -> dict:
    return {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream, include_usage", [(False, None), (True, False), (True, True)])
def test_call_patterns(server, kind, route, n, stream, include_usage):
    kw = dict(model="tiny", max_tokens=6, n=n, seed=11, temperature=0.9, **route_kwargs(route))
    full = call(server, kind, route, **kw)
    assert [c.index for c in full.choices] == list(range(n))
    assert all(c.finish_reason in ("stop", "length") for c in full.choices)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    if not stream:
        return
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = call(server, kind, route, stream=True, **kw, **extra)
    body = chunks
    if include_usage:
        *body, last = chunks
        assert last.choices == [] and last.usage == full.usage
    assert all(c.usage is None for c in body)
    assert all(len(c.choices) == 1 for c in body)  # `chunk.choices[0]` never fails
    assert len({c.id for c in chunks}) == 1
    texts, finishes, roles = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    for c in body:
        ch = c.choices[0]
        if route == "completions":
            texts[ch.index] += ch.text
        else:
            texts[ch.index] += ch.delta.content or ""
            roles[ch.index].append(ch.delta.role)
        finishes[ch.index].append(ch.finish_reason)
    assert texts == choice_texts(route, full)
    for i in range(n):  # the finish reason comes once, on the choice's last chunk
        assert finishes[i][-1] == full.choices[i].finish_reason
        assert all(f is None for f in finishes[i][:-1])
        if route == "chat":
            assert roles[i][0] == "assistant" and all(r is None for r in roles[i][1:])


def test_the_readme_streaming_loops(client):
    out = []
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, stream=True):
        out.append(chunk.choices[0].text)
    for chunk in client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, stream=True
    ):
        out.append(chunk.choices[0].delta.content or "")
    usage = None
    for chunk in client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            out.append(chunk.choices[0].text)
        else:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens >= 1


def sse_events(server: str, path: str, body: dict) -> list[str]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server}/v1/{path}", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("include_usage", [None, False, True])
def test_wire_format_of_streams(server, include_usage):
    # ignore_eos: a sampled EOS must not end the stream before the 4 tokens the usage counts
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True}
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    events = sse_events(server, "completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if include_usage:
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    else:
        assert all("usage" not in c for c in chunks)
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == "tiny"
    chat_body = {k: v for k, v in body.items() if k != "prompt"}
    chat = sse_events(server, "chat/completions", {**chat_body, "messages": MESSAGES})
    first = json.loads(chat[0])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last_choice = [json.loads(e) for e in chat[:-1] if json.loads(e)["choices"]][-1]["choices"][0]
    assert last_choice["finish_reason"] == "length"


def test_greedy_equals_transformers(client, tiny_model, tokenizer):
    prompts = ["hello world", PROMPT, "the cat sat on the mat and"]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    expected = [
        tokenizer.decode(t, skip_special_tokens=True) for t in hf_greedy(tiny_model, ids, 12)
    ]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in r.choices] == expected
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in r.choices] == expected
    chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    (chat_expected,) = hf_greedy(tiny_model, [chat_ids], 12)
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert r.choices[0].message.content == tokenizer.decode(chat_expected, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(chat_ids)


def test_completion_logprobs_match_transformers(client, tiny_model, tokenizer):
    from transformers import AutoModelForCausalLM

    ids = tokenizer(PROMPT)["input_ids"]
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    (generated,) = hf_greedy(tiny_model, [ids], len(lp.tokens))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1]
    ref = torch.log_softmax(logits.double(), -1)
    for k, tok in enumerate(generated):
        assert lp.tokens[k].strip() == tokenizer.decode([tok], skip_special_tokens=True)
        assert lp.token_logprobs[k] == pytest.approx(ref[k, tok].item(), rel=1e-4, abs=1e-5)
        top = ref[k].topk(2)
        want = {tokenizer.decode([int(t)]): v for t, v in zip(top.indices, top.values.tolist())}
        got = {key.strip(): v for key, v in lp.top_logprobs[k].items()}
        assert got.keys() == want.keys()  # greedy: the token is its own best alternative
        for key, v in want.items():
            assert got[key] == pytest.approx(v, rel=1e-4, abs=1e-5)


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode())
        assert t.logprob == pytest.approx(max(x.logprob for x in t.top_logprobs))
    chunks = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(t.top_logprobs == [] for t in streamed)


def test_streamed_completion_logprobs(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    full = client.completions.create(**kw).choices[0].logprobs
    tokens, offsets = [], []
    for c in client.completions.create(stream=True, **kw):
        if c.choices[0].logprobs:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
    assert tokens == full.tokens and offsets == full.text_offset


def test_stop_strings(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    words = client.completions.create(**kw).choices[0].logprobs.tokens
    stop = words[3]  # e.g. " dog": the text ends right before it
    if not stop.strip() or stop in "".join(words[:3]):
        pytest.skip("degenerate greedy text")
    for value in (stop, [stop, "zzz-not-there"]):
        r = client.completions.create(stop=value, **kw).choices[0]
        assert r.finish_reason == "stop" and r.text == "".join(words[:3])
        chunks = client.completions.create(stream=True, stop=value, **kw)
        assert "".join(c.choices[0].text for c in chunks) == r.text


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0)
    a = [client.completions.create(seed=s, **kw).choices[0].text for s in (1, 1, 2, 3)]
    assert a[0] == a[1] and len(set(a)) > 1


def test_n_best_of_and_echo(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=4)
    three = client.completions.create(n=3, logprobs=0, **kw).choices
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in three]
    best = client.completions.create(best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == three[max(range(3), key=mean.__getitem__)].text
    echo = client.completions.create(echo=True, n=2, **kw)
    assert [c.text for c in echo.choices] == [PROMPT + c.text for c in three[:2]]
    streamed = ["", ""]
    for c in client.completions.create(echo=True, n=2, stream=True, **kw):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == [c.text for c in echo.choices]


def test_batch_and_token_prompts(client, tokenizer):
    prompts = ["hello world", PROMPT]
    kw = dict(model="tiny", max_tokens=5, temperature=0, n=2)
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert [c.text for c in client.completions.create(prompt=ids, **kw).choices] == [
        c.text for c in r.choices
    ]
    streamed = [""] * 4
    for c in client.completions.create(prompt=prompts, stream=True, **kw):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == [c.text for c in r.choices]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)


def test_absent_max_tokens_fills_the_context(client):
    r = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_MODEL_LEN
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_MODEL_LEN


def test_logit_bias_penalties_and_user(client, tokenizer, tiny_model):
    from quantfw.engine import LLM, SamplingParams

    cat = tokenizer.convert_tokens_to_ids("cat")
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    r = client.completions.create(logit_bias={str(cat): 100}, user="alice", **kw)
    assert r.choices[0].text == " ".join(["cat"] * 5)
    plain = client.completions.create(logprobs=0, **kw).choices[0]
    first = tokenizer.convert_tokens_to_ids(plain.logprobs.tokens[0].strip())
    banned = client.completions.create(logit_bias={str(first): -100}, logprobs=0, **kw).choices[0]
    assert banned.logprobs.tokens[0].strip() != plain.logprobs.tokens[0].strip()
    # the penalties reach the engine's sampler (its arithmetic is tested in tests/engine)
    penalties = dict(presence_penalty=1.5, frequency_penalty=2.0)
    r = client.completions.create(**{**kw, "max_tokens": 12}, **penalties)
    llm = LLM(tiny_model, max_num_seqs=1)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, **penalties))
    assert r.choices[0].text == want[0].outputs[0].text


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "dog " * 400}, "prompt"),
        ("completions", {"prompt": "dog " * 200, "max_tokens": 100}, "max_tokens"),
        ("completions", {}, "prompt"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [[1, 2], "mixed"]}, "prompt"),
        ("completions", {"prompt": [1, 2, 100000]}, "prompt"),
        ("completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
        ("completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
        ("completions", {"prompt": "hi", "best_of": 1, "n": 2}, "best_of"),
        ("completions", {"prompt": "hi", "best_of": 3, "stream": True}, "best_of"),
        ("completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
        ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
        ("completions", {"prompt": "hi", "stop": ["ok", 3]}, "stop[1]"),
        ("completions", {"prompt": "hi", "n": 0}, "n"),
        ("completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),
        ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        (
            "completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            "completions",
            {"prompt": "hi", "stream": True, "stream_options": {"x": 1}},
            "stream_options.x",
        ),
        ("completions", {"prompt": "hi", "top_k": 0}, "top_k"),
        ("completions", {"prompt": "hi", "seed": 2**64}, "seed"),
        ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": "dog " * 300}]}, "messages"),
        ("chat", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ("chat", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        (
            "chat",
            {"messages": MESSAGES, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ("chat", {"messages": MESSAGES, "max_completion_tokens": 1000}, "max_completion_tokens"),
        ("chat", {"messages": MESSAGES, "functions": []}, "functions"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, route, body, param):
    path = "completions" if route == "completions" else "chat/completions"
    r = httpx.post(
        f"{server}/v1/{path}",
        json={"model": "tiny", **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_json_and_unknown_model(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(
        f"{server}/v1/completions", content=b'{"model": "tiny", "prompt": ', headers=headers
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.get(f"{server}/v1/nothing-here", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_openai_client_sees_400_and_server_stays_up(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"frobnicate": 1}
        )
    assert e.value.body["param"] == "frobnicate"
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).choices[0].text
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_models_and_api_key(client, server):
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics(server, client):
    client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    assert 'quantfw_requests_total{route="/v1/completions",status="200"}' in text
    assert 'quantfw_request_latency_seconds_count{route="/v1/completions"}' in text
    for name in (
        "quantfw_generation_tokens_total",
        "quantfw_engine_requests_aborted_total",
        "quantfw_kv_cache_free_blocks",
        "quantfw_num_requests_open 0.0",
        "quantfw_engine_dead 0.0",
    ):
        assert name in text
    httpx.get(f"{server}/no/such/{'x' * 20}")
    assert "/no/such" not in httpx.get(f"{server}/metrics").text  # bounded route labels
