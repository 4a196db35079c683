"""kbit on CUDA: launching the Triton kernels of ``kernels.py`` and the Gluon kernels of
``mma.py`` and ``wgmma.py``, config choice, tuning.

A call's config: the one ``tune()`` cached for its (M bucket, N, K, bits, dtype, device, made
for CUDA graphs or not) in this process, else the tuned table of this GPU model
(``kbit.tables``), else the heuristic ``configs.default_config``; resolved once per key, then a
dict lookup. The wgmma kernel serves only calls made for CUDA graphs (`_wgmma_allowed`) unless
a config names it. Nothing here
synchronizes with the host, so a call is CUDA-graph capturable once its config has been
compiled and the split-K workspace sized (warm up every M bucket before capturing).

The launch helpers take CPU tensors too: under ``TRITON_INTERPRET=1`` the kernels run in
Triton's interpreter (``sms`` then stands in for the SM count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from quantfw.kernels.common import is_sm90, splitk
from quantfw.kernels.common.launch_mode import graph_launches_active
from quantfw.kernels.common.timing import fastest_config
from quantfw.kernels.fused import GatedAct
from quantfw.kernels.kbit import format as kfmt
from quantfw.kernels.kbit.configs import candidate_configs, m_bucket
from quantfw.kernels.kbit.layout import KbitWeight, check_flat, padded_shape
from quantfw.kernels.kbit.tables import untuned_config
from quantfw.kernels.kbit.triton.kernels import (
    kbit_dequant_kernel,
    kbit_gemm_kernel,
    kbit_repack_kernel,
)
from quantfw.kernels.kbit.triton.mma import kbit_mma_matmul, lookup_table

_CONFIG_CACHE: dict[tuple, tuple] = {}
#: (column, block) pairs per repack program; divides every N_pad * KB_pad (a multiple of 128 * 8)
REPACK_BLOCKS = 128


def repack(
    planes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, name: str = "kbit weight"
) -> KbitWeight:
    """`layout.repack` on the tensors' device with ``kbit_repack_kernel``."""
    n, kb, bits, cb = check_flat(planes, absmax, codebook, name)
    n_pad, kb_pad = padded_shape(n, kb * kfmt.BLOCKSIZE)
    if n_pad * kb_pad * bits >= 2**31:
        raise ValueError(
            f"{name}: kbit kernels index the packed weight with int32; [{n}, {kb * 32}] at "
            f"{bits} bits has {n_pad * kb_pad * bits} words (at most 2**31 - 1)"
        )
    dev = planes.device
    qweight = torch.empty(n_pad, kb_pad * bits, dtype=torch.int32, device=dev)
    scales = torch.empty(n_pad, kb_pad, dtype=torch.uint8, device=dev)
    grid = (n_pad * kb_pad // REPACK_BLOCKS,)
    kbit_repack_kernel[grid](
        planes.contiguous(), absmax.contiguous(), qweight, scales, n, kb, kb_pad,
        BITS=bits, BLOCKS=REPACK_BLOCKS,
    )  # fmt: skip
    return KbitWeight(qweight, scales, cb, kb * kfmt.BLOCKSIZE, n)


def dequantize(
    weight: KbitWeight, dtype: torch.dtype, block_n: int = 128, block_k: int = 128, warps: int = 8
) -> torch.Tensor:
    """The dense ``[N, K]`` weight (``F.linear``'s layout) in `dtype`."""
    N, K = weight.out_features, weight.in_features
    n_pad, kb_pad = weight.scales.shape
    w = torch.empty(N, K, dtype=dtype, device=weight.qweight.device)
    grid = (n_pad // block_n, kb_pad * kfmt.BLOCKSIZE // block_k)
    kbit_dequant_kernel[grid](
        weight.qweight, weight.scales, weight.codebook, w, N, K, kb_pad,
        BITS=weight.bits, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return w


def gemm(
    x2: torch.Tensor,
    weight: KbitWeight,
    bias: torch.Tensor | None,
    cfg: tuple,
    sms: int | None = None,
    act: tuple[GatedAct, int] | None = None,
) -> torch.Tensor:
    """``x2 [M, K] @ W.T (+ bias)`` with the config `cfg` (x2 contiguous, fp16 or bf16);
    ``act``: a gated pair's activation of it (`ops.kbit_matmul`)."""
    if cfg[0] == "mma":
        _, warps, chunk, ctas_per_sm, copies, pipe = cfg
        return kbit_mma_matmul(
            x2, weight.qweight, weight.scales, _lookup_table(weight, x2.dtype),
            weight.out_features, weight.bits, bias, warps, chunk, ctas_per_sm, copies, pipe,
            act=act, owner=weight,
        )  # fmt: skip
    if cfg[0] == "wgmma":
        from quantfw.kernels.kbit.triton.wgmma import kbit_wgmma_matmul

        _, block_tokens, stages, chunk = cfg
        out = kbit_wgmma_matmul(x2, weight, bias, block_tokens, stages, chunk)
    else:
        out = _gemm(x2, weight, bias, cfg, sms)
    return out if act is None else act[0](out, act[1])


def _gemm(x2, weight: KbitWeight, bias, cfg: tuple, sms: int | None) -> torch.Tensor:
    """`gemm` with a "deq" or "fused" config."""
    if cfg[0] == "deq":
        _, block_n, block_k, warps = cfg
        return F.linear(x2, dequantize(weight, x2.dtype, block_n, block_k, warps), bias)
    if cfg[0] != "fused":
        raise ValueError(f"kbit: unknown kernel config {cfg!r}; kinds: mma, wgmma, fused, deq")
    _, bm, bn, bk, warps, stages, ctas_per_sm, swap = cfg
    M, K = x2.shape
    N = weight.out_features
    n_pad, kb_pad = weight.scales.shape
    tiles = (n_pad // bn) * triton.cdiv(M, bm)
    sms = splitk.num_sms(x2.device) if sms is None else sms
    steps = kb_pad * kfmt.BLOCKSIZE // bk
    split, iters = splitk.split_plan(steps, tiles, sms, ctas_per_sm)
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    # the (shared, zeroed) workspace is passed even when unused
    ws, cnt = splitk.workspace(x2.device, M * N if split > 1 else 1, tiles if split > 1 else 1)
    grid = (n_pad // bn, split, triton.cdiv(M, bm))
    kbit_gemm_kernel[grid](
        x2, weight.qweight, weight.scales, weight.codebook, out,
        bias if bias is not None else out, ws, cnt,
        M, N, K, kb_pad, x2.stride(0), out.stride(0), iters, steps,
        BITS=weight.bits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split > 1, SWAP=swap,
        HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _lookup_table(weight: KbitWeight, dtype: torch.dtype) -> torch.Tensor:
    """The mma kernel's table of `weight`'s codebook in `dtype`, built on first use (warm-up,
    before any CUDA graph capture) and kept with the weight. Built on the CPU and copied
    synchronously: the kernel reads it before its PDL wait (`common.pdl`), so no kernel may
    still be writing it."""
    luts = weight.__dict__.setdefault("_mma_luts", {})
    lut = luts.get(dtype)
    if lut is None:
        table = lookup_table(weight.codebook.cpu(), weight.bits, dtype)
        lut = luts[dtype] = table.to(weight.codebook.device)
    return lut


def _wgmma_allowed(x2: torch.Tensor) -> bool:
    """The wgmma kernel (two launches, ~100 us of host time a call) by default only on sm_90
    for calls made for CUDA graphs: eager short prefills are host-bound
    (benchmarks/kbit-lab-log.md §20)."""
    return is_sm90(x2.device) and graph_launches_active()


def _key(x2: torch.Tensor, weight: KbitWeight) -> tuple:
    return (
        m_bucket(x2.shape[0]),
        weight.out_features,
        weight.in_features,
        weight.bits,
        x2.dtype,
        x2.device.index,
        graph_launches_active(),
    )


def kbit_matmul_cuda(
    x2: torch.Tensor,
    weight: KbitWeight,
    bias: torch.Tensor | None = None,
    config: tuple | None = None,
    act: tuple[GatedAct, int] | None = None,
) -> torch.Tensor:
    """x2: [M, K] fp16/bf16 on CUDA; ``act``: see `ops.kbit_matmul`."""
    if x2.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"kbit_matmul: activations must be fp16 or bf16, got {x2.dtype}")
    if config is None:
        key = _key(x2, weight)
        config = _CONFIG_CACHE.get(key)
        if config is None:
            name = torch.cuda.get_device_name(x2.device)
            M, K = x2.shape
            config = untuned_config(
                name, M, weight.out_features, K, weight.bits, _wgmma_allowed(x2)
            )
            _CONFIG_CACHE[key] = config
    if bias is not None:
        bias = bias.contiguous()
    return gemm(x2.contiguous(), weight, bias, config, act=act)


def tune(x2, weight: KbitWeight, bias=None, rep_ms: float = 20.0, bench=None) -> tuple | None:
    """Time candidate_configs for this (M bucket, shape, dtype) and cache the fastest (at
    warm-up, never on the hot path). `bench(cfg)`, when given, returns the time of one call
    with `cfg`: pass one that rotates weight copies past L2. On sm_90 the wgmma kernel's
    configs are candidates too, timed without their host cost: tune calls made for CUDA
    graphs (inside `common.launch_mode.graph_launches`)."""
    best = fastest_config(
        candidate_configs(x2.shape[0], weight.bits, is_sm90(x2.device)),
        lambda cfg: kbit_matmul_cuda(x2, weight, bias, config=cfg),
        bench,
        rep_ms,
    )
    if best is not None:
        _CONFIG_CACHE[_key(x2, weight)] = best
    return best
