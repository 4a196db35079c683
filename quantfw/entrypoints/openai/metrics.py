"""``GET /metrics``: HTTP and engine metrics in the Prometheus text format (`prometheus_client`).

Each app has its own registry (several servers can live in one process). HTTP requests are
counted by route and status and timed to their last byte (`quantfw_request_latency_seconds`);
engine counters and gauges are read from the engine when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from quantfw.engine.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        llm = self.engine.engine
        stats = llm.stats
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens admitted", stats.prompt_tokens),
            ("generation_tokens", "Tokens generated", stats.generation_tokens),
            ("engine_steps", "Engine steps run", stats.steps),
            ("engine_requests_added", "Requests admitted by the engine", stats.requests_added),
            ("engine_requests_finished", "Requests finished", stats.requests_finished),
            ("engine_requests_aborted", "Requests aborted (client gone)", stats.requests_aborted),
            ("engine_requests_failed", "Requests that raised in the engine", stats.requests_failed),
        ):
            yield CounterMetricFamily(f"quantfw_{name}", doc, value=value)
        sched = llm.scheduler
        for name, doc, value in (
            ("num_requests_running", "Sequences holding a cache place", len(sched.running)),
            ("num_requests_waiting", "Sequences waiting for a cache place", len(sched.waiting)),
            ("num_requests_open", "Requests admitted and not yet done", self.engine.num_open),
            ("kv_cache_free_blocks", "Free blocks of the KV cache", llm.kv_cache.num_free),
            ("engine_dead", "1 after a failed engine step", int(self.engine.dead is not None)),
        ):
            yield GaugeMetricFamily(f"quantfw_{name}", doc, value=value)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, routes: set[str]):
        self.routes = routes
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "quantfw_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "quantfw_request_latency_seconds",
            "Time from request to last byte, /v1 routes",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))

    def observe(self, path: str, status: int, seconds: float) -> None:
        route = path if path in self.routes else "other"  # bounded label values
        self.requests.labels(route, str(status)).inc()
        if route.startswith("/v1/") and route != "/v1/models":
            self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
