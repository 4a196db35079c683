"""W4A16 on CUDA over the PackedW4 layout (quantfw/kernels/w4a16/layout.py): dispatch, tuning.

Four paths, chosen per M bucket and shape by a cached config (see tune()):

* ``("mma", warps, chunk, ctas_per_sm, pipe, fold, wk)`` (M <= 16, and to 64 off Hopper):
  the Gluon kernel of ``mma.py``; weights are dequantized in registers straight into
  ``mma.sync`` fragments (``fold``: zero and scale applied once per group on the fp32 sums;
  ``pipe``: the next chunk prefetched in registers; ``wk`` warps of a CTA per column block,
  each a k range, summed in shared memory), split-K partials of CTAs meet in a self-cleaning
  fp32 workspace inside the one launch.
* ``("ring", warps, chunk, stages, ctas_per_sm)`` (Hopper, M <= 16: a tuning candidate): the
  same math with the weight words brought in by TMA through a ``stages``-deep shared-memory
  ring (``ring.py``).
* ``("wg", tokens, warpgroups, ks, stages, ctas_per_sm)`` (M > 16 on Hopper): the
  Gluon kernel of ``wgmma.py``; weights dequantized in registers as the A operand of
  ``wgmma``, x tiles brought in by TMA, ``stages`` deep.
* ``("deq", BLOCK_KB, warps)`` (larger M elsewhere, and a tuning candidate on Hopper):
  ``_w4a16_dequant_kernel`` writes a transient ``[N, K]`` buffer in the activation dtype
  (freed after the call; never kept), then cuBLAS through ``F.linear``.

A call's config: the one ``tune()`` cached for its (M bucket, shape, dtype) in this process,
else the tuned table shipped for this GPU model (``w4a16.tables``), else the heuristic
``default_config``; resolved once per key, then a dict lookup.  Nothing here synchronizes with
the host, so a call is safe under CUDA graph capture once its config has been compiled (warm up
every M bucket before capturing).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from quantfw.kernels.common import is_sm90
from quantfw.kernels.common.timing import fastest_config
from quantfw.kernels.w4a16.configs import candidate_configs, default_config, m_bucket
from quantfw.kernels.w4a16.layout import dequantize_packed
from quantfw.kernels.w4a16.tables import untuned_config


@triton.jit
def _nibble(words, S: tl.constexpr):
    return (words >> (4 * S)) & 0xF


@triton.jit
def _w4a16_dequant_kernel(
    qf_ptr,  # int32 [NB, KB, 32, 4] (pack_mma)
    sz_ptr,  # int32 [n_groups, NB, 8, 8] (pack_mma_scales), x's dtype
    w_ptr,  # out: [N, K] in the activation dtype (F.linear's weight layout)
    K,
    N,
    KB,
    NB,
    G,
    BLOCK_KB: tl.constexpr,  # k16 steps per program
    ONE_GROUP: tl.constexpr,  # the tile's rows share one quantization group
    IS_BF16: tl.constexpr,
):
    """Dequantize a [16 * BLOCK_KB, 64] tile: coalesced word loads, nibbles put back in [K, N]
    order with join/permute, stored transposed into ``[N, K]`` rows of 16 * BLOCK_KB values
    (Triton routes the store through shared memory).  ``[N, K]`` because cuBLAS is faster on
    it than on ``[K, N]`` for some shapes."""
    nb = tl.program_id(0)
    kb0 = tl.program_id(1) * BLOCK_KB
    kb = kb0 + tl.arange(0, BLOCK_KB)
    lane_j = tl.arange(0, 128)
    words = tl.load(
        qf_ptr + nb * (KB * 128) + kb[:, None] * 128 + lane_j[None, :],
        mask=(kb < KB)[:, None],
        other=0,
    )
    words = tl.reshape(words, (BLOCK_KB, 8, 4, 4))  # kb, g, c, j
    # nibble s = 4h + 2t + e holds k = 16 kb + 8 e + 2 c + h, n = 64 nb + 16 j + 8 t + g
    v = tl.join(
        tl.join(
            tl.join(_nibble(words, 0), _nibble(words, 1)),
            tl.join(_nibble(words, 2), _nibble(words, 3)),
        ),
        tl.join(
            tl.join(_nibble(words, 4), _nibble(words, 5)),
            tl.join(_nibble(words, 6), _nibble(words, 7)),
        ),
    )  # kb, g, c, j, e, t, h (join adds the new dimension last)
    v = tl.permute(v, (0, 4, 2, 6, 3, 5, 1))  # kb, e, c, h | j, t, g
    q = tl.reshape(v, (BLOCK_KB * 16, 64))
    k = kb0 * 16 + tl.arange(0, BLOCK_KB * 16)
    n = tl.arange(0, 64)
    # scale/zero of column n sit at [grp, nb, g, 2j + t]
    sz_col = (n % 8) * 8 + 2 * (n // 16) + (n % 16) // 8
    if ONE_GROUP:
        sz = tl.load(sz_ptr + (kb0 * 16 // G) * (NB * 64) + nb * 64 + sz_col)[None, :]
    else:
        sz = tl.load(sz_ptr + ((k // G) * (NB * 64) + nb * 64)[:, None] + sz_col[None, :])
    if IS_BF16:
        dt = tl.bfloat16
        magic = 128.0
    else:
        dt = tl.float16
        magic = 1024.0
    s = (sz & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
    zm = ((sz >> 16) & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
    w = (q.to(tl.float32) + magic - zm) * s
    n = nb * 64 + n
    mask = (k < K)[:, None] & (n < N)[None, :]
    tl.store(w_ptr + k[:, None] + n[None, :] * K, w.to(dt), mask=mask)


# ---------------------------------------------------------------------------------------------
# configs and dispatch

_CONFIG_CACHE: dict[tuple, tuple] = {}
_KERNEL_OK: dict[tuple, bool] = {}


def _fallback(x2, packed, bias):
    w = dequantize_packed(packed, x2.dtype)
    out = x2 @ w
    return out if bias is None else out + bias


def _launch(x2, packed, bias, cfg):
    if cfg[0] == "deq":
        _, bkb, warps = cfg
        return torch.nn.functional.linear(x2, _dequantize(packed, x2.dtype, bkb, warps), bias)
    N, G = packed.out_features, packed.group_size
    sz = packed.scales_zeros_as(x2.dtype)
    if cfg[0] == "mma":
        from quantfw.kernels.w4a16.triton.mma import w4a16_mma_matmul

        _, warps, chunk, cps, pipe, fold, wk = cfg
        return w4a16_mma_matmul(
            x2, packed.qweight, sz, N, G, bias, warps, chunk, cps, pipe, fold, wk
        )
    if cfg[0] == "ring":
        from quantfw.kernels.w4a16.triton.ring import w4a16_ring_matmul

        _, warps, chunk, stages, cps = cfg
        return w4a16_ring_matmul(x2, packed.qweight, sz, N, G, bias, warps, chunk, stages, cps)
    if cfg[0] == "wg":
        from quantfw.kernels.w4a16.triton.wgmma import w4a16_wgmma_matmul

        _, bt, nwg, ks, stages, cps = cfg
        return w4a16_wgmma_matmul(x2, packed.qweight, sz, N, G, bias, bt, nwg, ks, stages, cps)
    raise ValueError(f"w4a16: unknown kernel config {cfg!r}; kinds: mma, ring, wg, deq")


def _dequantize(packed, dtype: torch.dtype, bkb: int = 8, warps: int = 4) -> torch.Tensor:
    """The dense ``[N, K]`` weight (``F.linear``'s layout) of the ``deq`` path, in ``dtype``."""
    K, N, G = packed.in_features, packed.out_features, packed.group_size
    NB, KB = packed.qweight.shape[:2]
    w = torch.empty(N, K, device=packed.qweight.device, dtype=dtype)
    _w4a16_dequant_kernel[(NB, triton.cdiv(KB, bkb))](
        packed.qweight, packed.scales_zeros_as(dtype), w, K, N, KB, NB, G,
        BLOCK_KB=bkb, ONE_GROUP=G >= K or G % (16 * bkb) == 0,
        IS_BF16=dtype == torch.bfloat16, num_warps=warps,
    )  # fmt: skip
    return w


def _run(x2, packed, bias, cfg):
    M, K = x2.shape
    N, G = packed.out_features, packed.group_size
    if packed.in_features > G and G % 16:  # irregular act-order groups: unfused fallback
        return _fallback(x2, packed, bias)
    if cfg[0] in ("wg", "ring") and not _is_hopper(x2):
        cfg = default_config(M, N, K, G)
    # a kernel kind that failed once on this device and dtype falls back to the next one:
    # wg / ring -> the default off Hopper (mma or deq), mma -> deq
    while cfg[0] != "deq":
        key = (x2.device.index, x2.dtype, cfg[0])
        nxt = ("deq", 8, 4) if cfg[0] == "mma" else default_config(M, N, K, G)
        if key not in _KERNEL_OK:
            try:
                out = _launch(x2, packed, bias, cfg)
                _KERNEL_OK[key] = True
                return out
            except Exception as e:  # Gluon / inline PTX / TMA unavailable on this toolchain
                _KERNEL_OK[key] = False
                warnings.warn(
                    f"w4a16: {cfg[0]} kernel unavailable ({e!r:.300}); using {nxt[0]}",
                    stacklevel=3,
                )
        if _KERNEL_OK[key]:
            break
        cfg = nxt
    return _launch(x2, packed, bias, cfg)


try:  # Gluon's Hopper API (TMA, wgmma) is missing from older Tritons
    from triton.experimental.gluon.language.nvidia import hopper as _gluon_hopper  # noqa: F401

    import quantfw.kernels.w4a16.triton.mma  # noqa: F401

    _GLUON_HOPPER = True
except ImportError:
    _GLUON_HOPPER = False


def _is_hopper(x2) -> bool:
    """sm_90 and a Triton with Gluon's Hopper API: the ``ring`` and ``wg`` kernels can run."""
    return _GLUON_HOPPER and is_sm90(x2.device)


def _key(x2, packed):
    M, dev = x2.shape[0], x2.device.index
    return (m_bucket(M), packed.out_features, packed.in_features, packed.group_size, x2.dtype, dev)


def w4a16_matmul_cuda(x2, packed, bias=None, config: tuple | None = None):
    """x2: [M, K] fp16/bf16 on CUDA (columns already permuted for act-order)."""
    if x2.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"w4a16_matmul: activations must be fp16 or bf16, got {x2.dtype}")
    M, K = x2.shape
    if config is None:
        key = _key(x2, packed)
        config = _CONFIG_CACHE.get(key)
        if config is None:
            name = torch.cuda.get_device_name(x2.device)
            N, G = packed.out_features, packed.group_size
            config = untuned_config(name, M, N, K, G, _is_hopper(x2))
            _CONFIG_CACHE[key] = config
    if bias is not None:
        bias = bias.contiguous()
    return _run(x2.contiguous(), packed, bias, config)


def tune(x2, packed, bias=None, rep_ms: float = 20.0, bench=None) -> tuple:
    """Time candidate_configs for this (M bucket, shape, dtype) and cache the fastest.

    Done once per bucket at warm-up; the hot path then only does a dict lookup. `bench(cfg)`,
    when given, returns the time of one call with `cfg`: pass one that rotates weight copies
    past L2, because timing one copy (the default) favours configs that only win when the
    weight is cached."""
    best = fastest_config(
        candidate_configs(x2.shape[0], _is_hopper(x2)),
        lambda cfg: w4a16_matmul_cuda(x2, packed, bias, config=cfg),
        bench,
        rep_ms,
    )
    if best is not None:
        _CONFIG_CACHE[_key(x2, packed)] = best
    return best
