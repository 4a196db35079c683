"""`benchmarks/bench_serving.py` on the CPU: a tiny bundled model served under a request stream;
its metrics agree with the workload it was given."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_serving.py")


def _module():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_workload_is_reproducible_and_poisson():
    bench = _module()
    w = bench.Workload(num_requests=400, prompt_len=(3, 9), answer_len=(2, 5), seed=3)
    reqs = w.requests(vocab=50)
    assert reqs == w.requests(vocab=50)
    assert {len(p) for p, _ in reqs} == set(range(3, 10))
    assert {a for _, a in reqs} == {2, 3, 4, 5}
    assert all(0 <= t < 50 for p, _ in reqs for t in p)
    times = w.arrivals(20.0)
    assert times == sorted(times) and times[0] > 0
    assert 400 / times[-1] == pytest.approx(20.0, rel=0.15)
    assert w.arrivals(math.inf) == [0.0] * 400


def test_arms_parse_and_refuse_bad_specs():
    bench = _module()
    got = bench.parse_arms("on:; off:prefill_graph_tokens=0,attention_backend=triton")
    assert got == [("on", {}), ("off", {"prefill_graph_tokens": 0, "attention_backend": "triton"})]
    for bad in ("", "a:;a:", ":x=1", "a:x"):
        with pytest.raises(ValueError):
            bench.parse_arms(bad)


def test_serving_run_accounts_for_every_request(tmp_path):
    bench = _module()
    out = tmp_path / "serving.json"
    bench.main(
        ["tiny-llama", "--num-requests", "10", "--prompt-len", "3,30", "--answer-len", "2,9",
         "--rates", "100,inf", "--dtype", "float32", "--max-model-len", "128",
         "--max-num-seqs", "4", "--arms", "one:;two:max_num_batched_tokens=16", "--out",
         str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert [(r["arm"], r["rate"]) for r in result["runs"]] == [
        ("one", 100.0),
        ("one", math.inf),
        ("two", 100.0),
        ("two", math.inf),
    ]
    reqs = bench.Workload(10, (3, 30), (2, 9), 0).requests(result_vocab(result))
    for run in result["runs"]:
        m = run["metrics"]
        assert m["output_tokens"] == sum(a for _, a in reqs)
        assert m["prompt_tokens"] == sum(len(p) for p, _ in reqs)
        # at most 4 sequences a step: every answer's tokens take steps of their own
        assert m["engine_steps"] >= max(a for _, a in reqs)
        assert 0 < m["ttft"]["median_ms"] <= m["ttft"]["p99_ms"]
        assert m["tpot"]["mean_ms"] > 0
        assert m["output_tokens_per_s"] == pytest.approx(m["output_tokens"] / m["duration_s"])
    assert "| one | inf |" in (tmp_path / "serving.md").read_text()


def result_vocab(result: dict) -> int:
    from quantfw.bench.configs import read_hf_config

    return read_hf_config(result["model"])[0]["vocab_size"]


def test_serve_refuses_a_run_whose_answers_are_short():
    """A request that ends before its answer length (a stop token) is an error, not a figure."""
    bench = _module()

    class Engine:
        stats = type("S", (), {"steps": 0})()

        def __init__(self):
            self.left = []

        def add_request(self, prompt, params):
            self.left.append(params.max_tokens)
            return "r0"

        def has_unfinished(self):
            return bool(self.left)

        def step(self):
            self.left.clear()
            done = type("C", (), {"token_ids": [5]})()
            return [type("O", (), {"request_id": "r0", "outputs": [done], "finished": True})()]

    with pytest.raises(RuntimeError, match="answer lengths"):
        bench.serve(Engine(), [([1, 2], 3)], [0.0])
