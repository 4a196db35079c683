"""The bounded load test (benchmarks/bench_server_load.py) against the session's server: 64
concurrent streamed requests, 10% of the clients leaving early, malformed ones interleaved."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest

pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

API_KEY = "sk-test-key"  # the key the `server` fixture starts with
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_server_load.py")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_server_load", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_server_holds_under_load(server):
    result = asyncio.run(load_bench().run_load(server, api_key=API_KEY, model="tiny"))
    assert all(result["checks"].values()), result
    assert result["requests"] == 64 and result["disconnects"] == 6 and result["malformed"] == 8
