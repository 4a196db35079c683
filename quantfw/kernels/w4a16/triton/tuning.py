"""Tuning W4A16 configs on the GPU at hand, timed the way the benchmark times them
(`quantfw.kernels.common.timing`: CUDA-graph replays over random weights rotated past L2).

``tune_shapes`` tunes every ``(N, K, G)`` and M and returns the table that
``w4a16.tables.write_table`` stores; ``quantfw tune-w4a16`` and ``benchmarks/bench_w4a16.py``
both use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from quantfw.kernels.common import timing
from quantfw.kernels.w4a16 import layout as W
from quantfw.kernels.w4a16.triton import dispatch as TK


def packed_bytes(K: int, N: int, G: int) -> int:
    """Bytes a W4A16 call reads for the weight: int4 codes, fp16 scales, int4 zeros."""
    groups = math.ceil(K / G)
    return K * N // 2 + groups * N * 2 + groups * N // 2


def random_awq(
    K: int, N: int, G: int, device: torch.device | str, dtype: torch.dtype = torch.float16
) -> W.PackedW4:
    """A random AWQ-layout weight (scales 1e-3..1.1e-2) repacked for `dtype` activations."""
    ng = math.ceil(K / G)
    qw = torch.randint(-(2**31), 2**31 - 1, (K, N // 8), dtype=torch.int32, device=device)
    qz = torch.randint(-(2**31), 2**31 - 1, (ng, N // 8), dtype=torch.int32, device=device)
    sc = (torch.rand(ng, N, device=device) * 0.01 + 0.001).half()
    return W.repack_awq(qw, qz, sc, G, dtype)


def rotated_timer(x: torch.Tensor, packs: list[W.PackedW4], est_us: float):
    """``tune()``'s timer: one config's time per call over the rotated weight copies."""

    def time_config(cfg: tuple) -> float:
        return timing.graph_time(
            [lambda p=p: TK.w4a16_matmul_cuda(x, p, config=cfg) for p in packs], est_us
        )

    return time_config


def tune_shapes(
    shapes: Iterable[tuple[int, int, int]],
    ms: Iterable[int],
    dtype: torch.dtype = torch.float16,
    log: Callable[[str], None] = print,
) -> dict[tuple[int, int, int], dict[int, tuple]]:
    """{(N, K, G): {M: best config}} for each ``(N, K, G)`` and M."""
    return timing.tune_shapes(
        shapes,
        ms,
        weight_bytes=lambda s: packed_bytes(s[1], s[0], s[2]),
        random_weight=lambda s: random_awq(s[1], s[0], s[2], "cuda", dtype),
        tune=lambda x, packed, bench: TK.tune(x, packed, bench=bench),
        call=lambda x, packed, cfg: TK.w4a16_matmul_cuda(x, packed, config=cfg),
        dtype=dtype,
        log=log,
    )
