"""Tuning W4A16 configs on the GPU at hand, timed the way the benchmark times them.

A config is timed as CUDA-graph replays of many calls that rotate over enough random weight
copies that L2 cannot hold them: timing one cached copy favours configs that only win on hot
weights (docs/kernels-w4a16.md).  ``tune_shapes`` tunes every (shape, M) and returns the
table that ``w4a16_tables.write_table`` stores; ``quantfw tune-w4a16`` and
``benchmarks/bench_w4a16.py`` both use it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable

import torch

from quantfw.kernels import w4a16 as W
from quantfw.kernels.triton import w4a16_kernels as TK


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
    methods in turn, the order rotated every round.  Without the idle gap, on an H200 the same
    config measured 3-10% slower at M = 4096 when it ran right after other heavy calls."""
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
    after 20 ms of idle GPU (launch overhead excluded alike for every method; the idle gap
    keeps ``tune()`` from favouring the candidates it times first)."""
    return graph_times([calls], est_us, rounds=1, iters=7)[0]


def n_copies(nbytes: int, l2_bytes: int) -> int:
    """Weight copies to rotate over so that they exceed 3x L2 (2..64)."""
    return max(2, min(64, math.ceil(3 * l2_bytes / nbytes)))


def packed_bytes(K: int, N: int, G: int) -> int:
    """Bytes a W4A16 call reads for the weight: int4 codes, fp16 scales, int4 zeros."""
    groups = math.ceil(K / G)
    return K * N // 2 + groups * N * 2 + groups * N // 2


def random_awq(K: int, N: int, G: int, device: torch.device | str) -> W.PackedW4:
    """A random AWQ-layout weight (scales 1e-3..1.1e-2) repacked for the kernels."""
    ng = math.ceil(K / G)
    qw = torch.randint(-(2**31), 2**31 - 1, (K, N // 8), dtype=torch.int32, device=device)
    qz = torch.randint(-(2**31), 2**31 - 1, (ng, N // 8), dtype=torch.int32, device=device)
    sc = (torch.rand(ng, N, device=device) * 0.01 + 0.001).half()
    return W.repack_awq(qw, qz, sc, G)


def rotated_timer(x: torch.Tensor, packs: list[W.PackedW4], est_us: float):
    """``tune()``'s timer: one config's time per call over the rotated weight copies."""

    def time_config(cfg: tuple) -> float:
        return graph_time(
            [lambda p=p: TK.w4a16_matmul_cuda(x, p, config=cfg) for p in packs], est_us
        )

    return time_config


def tune_shapes(
    shapes: Iterable[tuple[int, int, int]],
    ms: Iterable[int],
    dtype: torch.dtype = torch.float16,
    log: Callable[[str], None] = print,
) -> dict[tuple[int, int, int], dict[int, tuple]]:
    """{(N, K, G): {M: best config}} for each ``(N, K, G)`` and M, on random weights rotated
    past L2 (each shape's copies are freed before the next)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    table: dict[tuple[int, int, int], dict[int, tuple]] = {}
    for N, K, G in shapes:
        nbytes = packed_bytes(K, N, G)
        packs = [random_awq(K, N, G, "cuda") for _ in range(n_copies(nbytes, l2))]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            # a rough floor (3 TB/s, 500 TFLOP/s): it only sizes the timed graphs
            est_us = max((nbytes + 2 * M * (K + N)) / 3e12, 2 * M * N * K / 500e12) * 1e6
            cfg = TK.tune(x, packs[0], bench=rotated_timer(x, packs, est_us))
            if cfg is None:
                raise RuntimeError(f"w4a16 tuning: no candidate config ran for N={N} K={K} M={M}")
            table.setdefault((N, K, G), {})[M] = cfg
            log(f"N={N} K={K} G={G} M={M}: {cfg}")
        del packs
        torch.cuda.empty_cache()
    return table
