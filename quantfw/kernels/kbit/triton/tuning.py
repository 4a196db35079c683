"""Tuning kbit configs on the GPU at hand, timed the way the benchmark times them
(`quantfw.kernels.common.timing`: CUDA-graph replays over random weights rotated past L2).

``tune_shapes`` tunes every ``(N, K, bits)`` and M and returns the table that
``kbit.tables.TABLES.write_table`` stores; ``benchmarks/bench_kbit.py`` uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from quantfw.kernels.common import timing
from quantfw.kernels.kbit import layout
from quantfw.kernels.kbit.triton import dispatch


def random_kbit(N: int, K: int, bits: int, device: torch.device | str) -> layout.KbitWeight:
    """A random field-packed kbit weight: random bit planes, E4M4 scales of 1e-3 .. 8e-3, the
    normal-float codebook (repacked on `device`)."""
    from quantfw.kernels.kbit import format as kfmt

    kb = K // kfmt.BLOCKSIZE
    planes = torch.randint(-(2**31), 2**31 - 1, (N, kb, bits), dtype=torch.int32, device=device)
    absmax = torch.randint(16, 64, (N, kb), dtype=torch.uint8, device=device)
    return dispatch.repack(planes, absmax, kfmt.normal_float_codebook(bits))


def tune_shapes(
    shapes: Iterable[tuple[int, int, int]],
    ms: Iterable[int],
    dtype: torch.dtype = torch.float16,
    log: Callable[[str], None] = print,
) -> dict[tuple[int, int, int], dict[int, tuple]]:
    """{(N, K, bits): {M: best config}} for each ``(N, K, bits)`` and M."""
    return timing.tune_shapes(
        shapes,
        ms,
        weight_bytes=lambda s: layout.tiled_nbytes(s[0], s[1], s[2]),
        random_weight=lambda s: random_kbit(s[0], s[1], s[2], "cuda"),
        tune=lambda x, w, bench: dispatch.tune(x, w, bench=bench),
        call=lambda x, w, cfg: dispatch.kbit_matmul_cuda(x, w, config=cfg),
        dtype=dtype,
        log=log,
    )
