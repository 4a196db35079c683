"""Timing GPU matmuls the way the benchmarks and tuning time them (shared by every kernel family).

A method is timed as CUDA-graph replays of many calls that rotate over enough random weight
copies that L2 cannot hold them: timing one cached copy favours configs that only win on hot
weights. Graph replays exclude launch overhead alike for every method. ``tune_shapes`` runs a
family's ``tune(x, weight, bench)`` over shapes and token counts and returns the table that
``ConfigTables.write_table`` stores.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch


def events_median(fn: Callable[[], object], iters: int = 7) -> float:
    """Median time of ``fn()`` in microseconds over ``iters`` CUDA-event-timed calls."""
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    fn()
    torch.cuda.synchronize()
    for i in range(iters):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end)) * 1e3


def _capture(calls: list[Callable[[], object]], est_us: float) -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph of enough calls rotating over ``calls`` to last about 400 us."""
    n = len(calls)
    reps = n * max(1, math.ceil(400.0 / max(est_us, 1.0) / n))
    reps = min(reps, max(n, 2000))
    for c in calls:
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            calls[i % n]()
    return g, reps


def graph_times(
    methods: list[list[Callable[[], object]]],
    est_us: float,
    rounds: int = 5,
    iters: int = 3,
    idle_s: float = 0.02,
) -> list[float]:
    """Median time of one call (us) of each method (a list of calls over rotated copies): each
    method's graph is replayed ``iters`` times per round after ``idle_s`` of idle GPU, the
    methods in turn, the order rotated every round (what ran just before a method otherwise
    shifts its time)."""
    graphs = [_capture(calls, est_us) for calls in methods]
    samples: list[list[float]] = [[] for _ in graphs]
    for r in range(rounds):
        for i in range(len(graphs)):
            j = (i + r) % len(graphs)
            g, reps = graphs[j]
            torch.cuda.synchronize()
            time.sleep(idle_s)
            samples[j].append(events_median(g.replay, iters) / reps)
    del graphs
    return [statistics.median(s) for s in samples]


def graph_time(calls: list[Callable[[], object]], est_us: float) -> float:
    """Median time of one call (us): a CUDA graph of calls rotating over ``calls``, 7 replays
    after 20 ms of idle GPU (so that tuning does not favour the candidates it times first)."""
    return graph_times([calls], est_us, rounds=1, iters=7)[0]


def n_copies(nbytes: int, l2_bytes: int) -> int:
    """Weight copies to rotate over so that they exceed 3x L2 (2..64)."""
    return max(2, min(64, math.ceil(3 * l2_bytes / nbytes)))


def rough_time_us(weight_bytes: int, M: int, N: int, K: int) -> float:
    """A rough floor (3 TB/s, 500 TFLOP/s) of one [M, K] x [K, N] call: it only sizes the
    timed graphs."""
    return max((weight_bytes + 2 * M * (K + N)) / 3e12, 2 * M * N * K / 500e12) * 1e6


def fastest_config(
    candidates: Sequence[tuple],
    call: Callable[[tuple], object],
    bench: Callable[[tuple], float] | None = None,
    rep_ms: float = 20.0,
) -> tuple | None:
    """The candidate whose ``call(cfg)`` is fastest: timed by ``bench(cfg)`` when given (pass a
    rotated-weight timer), else by ``triton.testing.do_bench`` on one weight. Candidates the
    compiler rejects (shared memory, registers) are skipped; None when none ran."""
    best, best_t = None, float("inf")
    for cfg in candidates:
        try:
            call(cfg)
            if bench is None:
                import triton.testing

                t = triton.testing.do_bench(
                    lambda cfg=cfg: call(cfg), warmup=5, rep=rep_ms, return_mode="median"
                )
            else:
                t = bench(cfg)
        except Exception:
            continue
        if t < best_t:
            best, best_t = cfg, t
    return best


def tune_shapes(
    shapes: Iterable[tuple[int, ...]],
    ms: Iterable[int],
    *,
    weight_bytes: Callable[[tuple[int, ...]], int],
    random_weight: Callable[[tuple[int, ...]], object],
    tune: Callable[[torch.Tensor, object, Callable[[tuple], float]], tuple | None],
    call: Callable[[torch.Tensor, object, tuple], object],
    dtype: torch.dtype = torch.float16,
    log: Callable[[str], None] = print,
) -> dict[tuple[int, ...], dict[int, tuple]]:
    """{shape: {M: best config}} for each shape ``(N, K, ...)`` and M, on random weights
    (``random_weight(shape)``) rotated past L2; each shape's copies are freed before the next.
    ``tune(x, weight, bench)`` picks and caches a config, timed by ``bench(cfg)``, which times
    ``call(x, weight, cfg)`` over the copies."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    table: dict[tuple[int, ...], dict[int, tuple]] = {}
    for shape in shapes:
        N, K = shape[0], shape[1]
        nbytes = weight_bytes(shape)
        weights = [random_weight(shape) for _ in range(n_copies(nbytes, l2))]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            est_us = rough_time_us(nbytes, M, N, K)

            def bench(cfg: tuple, x=x, weights=weights, est_us=est_us) -> float:
                return graph_time([lambda w=w: call(x, w, cfg) for w in weights], est_us)

            cfg = tune(x, weights[0], bench)
            if cfg is None:
                raise RuntimeError(f"tuning: no candidate config ran for shape {shape} M={M}")
            table.setdefault(tuple(shape), {})[M] = cfg
            log(f"shape {shape} M={M}: {cfg}")
        del weights
        torch.cuda.empty_cache()
    return table
