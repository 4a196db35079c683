"""Load test of `quantfw serve` on 127.0.0.1 with the official openai client (async).

64 concurrent streamed requests (completions and chat, mixed prompt and answer lengths, greedy
and seeded sampling), 10% of the clients disconnecting after two chunks, malformed requests
interleaved. Checks: every completed answer equals the same request's answer when run alone
(serially, before), each request admitted exactly once (engine counters: added = requests,
finished + aborted = added, aborted = disconnects), every malformed request a 400, the cache's
free blocks and open requests back to their starting values, the server still answering.

    python benchmarks/bench_server_load.py --out benchmarks/results/server-load-CPU-DATE.json

starts its own server on a tiny random model (as the tests do); ``--url`` loads a running one
instead (its model must be served as ``--model``; the checks need a tokenizer and /metrics).
`tests/server/test_load.py` runs `run_load` in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

import httpx
import openai

#: prompts are drawn from these words (all in the tiny test tokenizer's vocabulary)
SENTENCE = (
    "the quick brown fox jumps over the lazy dog a cat sat on the mat hello world how are you"
)
MALFORMED = [
    ("completions", b'{"model": "tiny", "prompt": '),
    ("completions", {"prompt": "hi", "temperature": "hot"}),
    ("completions", {"prompt": "dog " * 400}),
    ("completions", {"prompt": "hi", "frobnicate": 1}),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("completions", {"prompt": [1, 2, 10**6]}),
    ("completions", {"prompt": "hi", "stream": True, "best_of": 3}),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}),
]


def plan(num_requests: int, disconnect_fraction: float, seed: int) -> list[dict]:
    """The requests: route, body fields, and whether the client leaves early."""
    rng = random.Random(seed)
    words = SENTENCE.split()
    leaving = set(
        rng.sample(range(num_requests), max(1, round(disconnect_fraction * num_requests)))
    )
    specs = []
    for i in range(num_requests):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        body: dict = {"temperature": 0.0}
        if i % 4 == 3:
            body = {"temperature": 0.8, "seed": i}
        if i in leaving:  # a long answer (the rest of the context), left after two chunks
            body["extra_body"] = {"ignore_eos": True}
        else:
            body["max_tokens"] = rng.randint(4, 48)
        if i % 3 == 2:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        specs.append({"i": i, "body": body, "leave": i in leaving})
    return specs


async def stream_one(client: openai.AsyncOpenAI, model: str, spec: dict) -> dict:
    body = spec["body"]
    create = client.chat.completions.create if "messages" in body else client.completions.create
    start = time.perf_counter()
    stream = await create(model=model, stream=True, stream_options={"include_usage": True}, **body)
    text, finish, ids, usage, chunks, first = "", None, set(), None, 0, None
    async for chunk in stream:
        ids.add(chunk.id)
        if not chunk.choices:
            usage = chunk.usage
            continue
        first = first or time.perf_counter() - start
        c = chunk.choices[0]
        text += c.text if "prompt" in body else c.delta.content or ""
        finish = c.finish_reason or finish
        chunks += 1
        if spec["leave"] and chunks == 2:
            await stream.close()
            break
    return {"text": text, "finish": finish, "ids": ids, "usage": usage, "ttft": first}


async def malformed_one(http: httpx.AsyncClient, path: str, body) -> int:
    if isinstance(body, bytes):
        r = await http.post(
            f"/v1/{path}", content=body, headers={"content-type": "application/json"}
        )
    else:
        r = await http.post(f"/v1/{path}", json={"model": "tiny", **body})
    return r.status_code


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("quantfw_") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def run_load(
    base_url: str,
    *,
    api_key: str | None = None,
    model: str = "tiny",
    num_requests: int = 64,
    disconnect_fraction: float = 0.1,
    seed: int = 0,
) -> dict:
    """Run the load test against a server; returns its figures and ``checks`` (all True when
    the server held)."""
    specs = plan(num_requests, disconnect_fraction, seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=api_key or "none", max_retries=0, timeout=120
    )
    async with client, httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as http:
        t = time.perf_counter()
        serial = {s["i"]: await stream_one(client, model, s) for s in specs if not s["leave"]}
        serial_seconds = time.perf_counter() - t
        before = await scrape(http)

        tasks = [stream_one(client, model, s) for s in specs]
        for k, (path, body) in enumerate(MALFORMED):  # spread among the streams
            tasks.insert(
                (k + 1) * len(tasks) // (len(MALFORMED) + 1), malformed_one(http, path, body)
            )
        t = time.perf_counter()
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - t
        statuses = [r for r in results if isinstance(r, int)]
        answers = dict(zip([s["i"] for s in specs], [r for r in results if isinstance(r, dict)]))

        settle = time.perf_counter()
        after = await scrape(http)
        while time.perf_counter() - settle < 10 and (
            after["quantfw_num_requests_open"]
            or after["quantfw_kv_cache_free_blocks"] != before["quantfw_kv_cache_free_blocks"]
        ):
            await asyncio.sleep(0.05)
            after = await scrape(http)
        probe = specs[0] if not specs[0]["leave"] else specs[1]
        again = await stream_one(client, model, probe)
        health = (await http.get("/health")).status_code

    def delta(name: str) -> int:
        return int(after[name] - before[name])

    completed = [s["i"] for s in specs if not s["leave"]]
    mismatched = [
        i
        for i in completed
        if (answers[i]["text"], answers[i]["finish"], answers[i]["usage"])
        != (serial[i]["text"], serial[i]["finish"], serial[i]["usage"])
    ]
    stream_ids = [a["ids"] for a in answers.values()]
    leaving = num_requests - len(completed)
    ttfts = sorted(a["ttft"] for a in answers.values() if a["ttft"] is not None)
    checks = {
        "completed_equal_serial": not mismatched,
        "one_id_per_stream_all_distinct": all(len(ids) == 1 for ids in stream_ids)
        and len(set().union(*stream_ids)) == num_requests,
        "each_request_admitted_once": delta("quantfw_engine_requests_added_total") == num_requests,
        "finished_plus_aborted_is_added": delta("quantfw_engine_requests_finished_total")
        + delta("quantfw_engine_requests_aborted_total")
        == num_requests,
        "aborted_are_the_disconnects": delta("quantfw_engine_requests_aborted_total") == leaving,
        "malformed_all_400": statuses == [400] * len(MALFORMED),
        "cache_free_blocks_restored": after["quantfw_kv_cache_free_blocks"]
        == before["quantfw_kv_cache_free_blocks"],
        "no_request_left_open": after["quantfw_num_requests_open"] == 0,
        "server_answers_after": health == 200
        and (again["text"], again["finish"])
        == (serial[probe["i"]]["text"], serial[probe["i"]]["finish"]),
    }
    generated = delta("quantfw_generation_tokens_total")
    return {
        "requests": num_requests,
        "completed": len(completed),
        "disconnects": leaving,
        "malformed": len(MALFORMED),
        "seconds": round(seconds, 3),
        "serial_seconds": round(serial_seconds, 3),
        "generated_tokens": generated,
        "tokens_per_second": round(generated / seconds, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_max_s": round(ttfts[-1], 4),
        "kv_cache_free_blocks": after["quantfw_kv_cache_free_blocks"],
        "mismatched": mismatched,
        "malformed_statuses": statuses,
        "checks": checks,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default="tiny", help="served model name (with --url)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8, help="of the server started here")
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args()
    import torch

    info = {
        "date": time.strftime("%Y-%m-%d"),
        "device": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        # other work on the machine slows every figure below
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
    }
    if args.url:
        result = asyncio.run(run_load(args.url, api_key=args.api_key, model=args.model))
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
        from server_utils import free_port, start_server, stop_server
        from tiny_checkpoint import build_model

        with tempfile.TemporaryDirectory() as tmp:
            model = build_model(os.path.join(tmp, "model"), "llama")
            port = free_port()
            cmd = [sys.executable, "-m", "quantfw.entrypoints.cli", "serve", model]
            cmd += ["--port", str(port), "--served-model-name", "tiny", "--log-level", "warning"]
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
            proc = start_server(cmd, port, os.path.join(tmp, "server.log"))
            try:
                result = asyncio.run(
                    run_load(f"http://127.0.0.1:{port}", num_requests=args.requests)
                )
            finally:
                stop_server(proc)
        info["server"] = {
            "model": "tiny random Llama (tests/support/tiny_checkpoint.py): 2 layers, hidden 64, "
            "vocab 128, max_model_len 256, fp32",
            "max_num_seqs": args.max_num_seqs,
        }
    result = {**info, **result}
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
