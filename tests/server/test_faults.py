"""Faults and load limits, on an app served by uvicorn in a thread of this process (so a test
can inject a fault into its engine): a request that raises, a dead engine, a full queue,
clients that disconnect (streamed or not)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from server_utils import ThreadServer  # noqa: E402

import quantfw.engine.engine as engine_module  # noqa: E402
from quantfw.engine.async_engine import AsyncEngine  # noqa: E402
from quantfw.engine.engine import LLMEngine  # noqa: E402
from quantfw.engine.sampler import apply_penalties  # noqa: E402
from quantfw.engine.sampling_params import SamplingParams  # noqa: E402
from quantfw.entrypoints.openai.api_server import build_app  # noqa: E402

FAULT_TOKEN = 100  # a prompt holding this token id fails when sampled (injected below)
PROMPTS = [[13, 14, 15], [23, 24, 25, 26, 27], [6, 7, 8, 9]]


@pytest.fixture
def serve(tiny_model):
    """Factory: (url, AsyncEngine) of a fresh engine served in this process."""
    started = []

    def make(max_running: int = 4, max_queued: int = 16, on_dead=None):
        engine = LLMEngine(tiny_model, max_num_seqs=max_running)
        async_engine = AsyncEngine(
            engine, max_running=max_running, max_queued=max_queued, on_dead=on_dead
        )
        server = ThreadServer(build_app(async_engine, "tiny"))
        started.append((server, async_engine))
        return server.url, async_engine

    yield make
    for server, async_engine in started:
        server.stop()
        async_engine.shutdown()


def faulty_sample(real):
    def sample(logits, seqs):
        if any(FAULT_TOKEN in s.prompt_token_ids for s in seqs):
            raise RuntimeError("injected sampling fault")
        return real(logits, seqs)

    return sample


def client(url: str, cls=openai.OpenAI):
    return cls(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def wait_until(condition, timeout: float = 5.0) -> float:
    """Seconds until `condition()` held (fails after `timeout`)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - start


def slow_steps(monkeypatch, engine: LLMEngine, seconds: float) -> None:
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    monkeypatch.setattr(engine, "step", step)


def test_engine_fails_one_request_alone(tiny_model, monkeypatch):
    engine = LLMEngine(tiny_model, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = engine.add_request(PROMPTS[0], params)
    while engine.has_unfinished():
        outs = {o.request_id: o for o in engine.step()}
    want = outs[alone].outputs[0].token_ids
    free = engine.kv_cache.num_free
    monkeypatch.setattr(engine_module, "sample", faulty_sample(engine_module.sample))
    good = engine.add_request(PROMPTS[0], params)
    bad = engine.add_request([FAULT_TOKEN, *PROMPTS[1]], SamplingParams(n=2, max_tokens=6))
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            final[o.request_id] = o
    assert final[good].outputs[0].token_ids == want and final[good].error is None
    assert "injected sampling fault" in final[bad].error
    assert [c.finish_reason for c in final[bad].outputs] == ["error", "error"]
    assert engine.kv_cache.num_free == free and not engine.requests
    assert engine.stats.requests_failed == 1


def test_logit_bias_in_the_sampler():
    logits = torch.randn(16)
    biased = apply_penalties(logits, SamplingParams(logit_bias={3: 5.0, 7: -100}), [], [])
    want = logits.clone()
    want[3] += 5.0
    want[7] -= 100
    assert torch.equal(biased, want)
    with pytest.raises(ValueError, match="SamplingParams.logit_bias="):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="SamplingParams.logit_bias="):
        SamplingParams(logit_bias={-1: 1})


def test_request_that_raises_gets_500_and_the_others_go_on(serve, monkeypatch):
    url, async_engine = serve()
    sync = client(url)
    kw = dict(model="tiny", max_tokens=8, temperature=0)
    serial = [sync.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
    free = async_engine.engine.kv_cache.num_free
    monkeypatch.setattr(engine_module, "sample", faulty_sample(engine_module.sample))

    async def run():
        async with client(url, openai.AsyncOpenAI) as c:

            async def good(p, stream):
                if not stream:
                    return (await c.completions.create(prompt=p, **kw)).choices[0].text
                chunks = await c.completions.create(prompt=p, stream=True, **kw)
                return "".join([x.choices[0].text async for x in chunks])

            async def bad(stream):
                prompt = [FAULT_TOKEN, *PROMPTS[0]]
                if not stream:
                    await c.completions.create(prompt=prompt, **kw)
                else:
                    async for _ in await c.completions.create(prompt=prompt, stream=True, **kw):
                        pass

            jobs = [good(p, i % 2 == 1) for i, p in enumerate(PROMPTS)] + [bad(False), bad(True)]
            return await asyncio.gather(*jobs, return_exceptions=True)

    *texts, plain_error, stream_error = asyncio.run(run())
    assert texts == serial
    assert isinstance(plain_error, openai.InternalServerError)
    assert plain_error.status_code == 500 and "injected sampling fault" in plain_error.message
    assert isinstance(stream_error, openai.APIError) and "injected sampling fault" in str(
        stream_error
    )
    assert httpx.get(f"{url}/health").status_code == 200 and async_engine.dead is None
    assert async_engine.num_open == 0 and async_engine.engine.kv_cache.num_free == free
    assert sync.completions.create(prompt=PROMPTS[0], **kw).choices[0].text == serial[0]


def test_dead_engine_fails_open_requests_and_health(serve, monkeypatch):
    deaths = []
    url, async_engine = serve(on_dead=deaths.append)
    sync = client(url)
    assert httpx.get(f"{url}/health").status_code == 200
    runner = async_engine.engine.runner

    def broken(batch):
        raise RuntimeError("injected step fault")

    monkeypatch.setattr(runner, "execute", broken)
    with pytest.raises(openai.InternalServerError, match="injected step fault"):
        sync.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "injected step fault" in health.json()["detail"]
    with pytest.raises(openai.APIStatusError) as e:
        sync.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4)
    assert e.value.status_code == 503 and e.value.body["code"] == "engine_dead"
    assert len(deaths) == 1 and async_engine.num_open == 0
    assert "quantfw_engine_dead 1.0" in httpx.get(f"{url}/metrics").text


def test_full_queue_answers_503(serve, monkeypatch):
    url, async_engine = serve(max_running=1, max_queued=1)
    slow_steps(monkeypatch, async_engine.engine, 0.005)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    with httpx.Client(base_url=url, timeout=30) as h:
        with (
            h.stream("POST", "/v1/completions", json=body) as a,
            h.stream("POST", "/v1/completions", json=body) as b,
        ):
            assert a.status_code == b.status_code == 200
            r = h.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
            assert "retry later" in r.json()["error"]["message"]
        too_many = h.post("/v1/completions", json={**body, "prompt": PROMPTS, "stream": False})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    wait_until(lambda: async_engine.num_open == 0)
    r = client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_disconnect_frees_the_sequence_at_once(serve, monkeypatch):
    url, async_engine = serve()
    engine = async_engine.engine
    free = engine.kv_cache.num_free
    slow_steps(monkeypatch, engine, 0.01)  # 240 tokens take >= 2.4 s
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 240, "ignore_eos": True}
    with (
        httpx.Client(base_url=url, timeout=30) as h,
        h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert engine.kv_cache.num_free < free
    freed_in = wait_until(lambda: engine.kv_cache.num_free == free and not engine.requests)
    assert freed_in < 1.0 and async_engine.num_open == 0
    assert engine.stats.requests_aborted == 1 and engine.stats.generation_tokens < 120
    with pytest.raises(httpx.ReadTimeout):  # a plain request whose client gives up
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    freed_in = wait_until(lambda: engine.stats.requests_aborted == 2 and not engine.requests)
    assert freed_in < 1.0 and engine.kv_cache.num_free == free
    assert engine.stats.generation_tokens < 240


def test_the_engine_thread_tells_decode_windows_of_arrivals(tiny_model):
    """`AsyncEngine` gives its engine `arrivals_waiting`: whether its inbox holds anything, so a
    decode window running on the GPU ends early for a request that arrived meanwhile."""
    engine = LLMEngine(tiny_model, max_num_seqs=2)
    async_engine = AsyncEngine(engine)
    assert engine.arrivals_waiting() is False
    async_engine.shutdown()  # the thread is gone: what is put now stays in the inbox
    async_engine._inbox.put(("abort", "req-0"))
    assert engine.arrivals_waiting() is True
