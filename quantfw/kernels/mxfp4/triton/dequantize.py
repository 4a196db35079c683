"""Whole MXFP4 experts to the activation dtype (the prefill path: a dense grouped GEMM then runs
on tensor cores), from the runtime layout of `mxfp4.layout`, decoded as the grouped GEMM decodes
its tiles (`grouped_gemm._decode_tile`) and put back in input order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.mxfp4.triton.grouped_gemm import _decode_tile

BLOCK_N, BLOCK_K = 64, 128


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, out_ptr, N, K, N_PAD, KP,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """grid (E, N / BLOCK_N, K_pad / BLOCK_K): out [E, N, K] from bytes [E, N_pad, K_pad / 2]
    and scales [E, N_pad, K_pad / 32]."""
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(2) * BLOCK_K
    n_ok = (n < N)[:, None]
    row = e * N_PAD + n.to(tl.int64)[:, None]
    j = tl.arange(0, BLOCK_K // 2)
    g = tl.arange(0, BLOCK_K // 32)
    packed = tl.load(w_ptr + row * (KP // 2) + k0 // 2 + j[None, :], mask=n_ok, other=0)
    s = tl.load(s_ptr + row * (KP // 32) + k0 // 32 + g[None, :], mask=n_ok, other=0)
    w = _decode_tile(packed, s, BLOCK_N, BLOCK_K)  # [BN, (q, j, r, 8)]: to (q, r, j, 8)
    w = tl.permute(tl.reshape(w, [BLOCK_N, BLOCK_K // 128, 4, 4, 8]), (0, 1, 3, 2, 4))
    w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    k = k0 + tl.arange(0, BLOCK_K)
    out = out_ptr + (e * N + n.to(tl.int64)[:, None]) * K + k[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_ok & (k < K)[None, :])


def dequantize(weights, dtype: torch.dtype) -> torch.Tensor:
    """`grouped.Mxfp4Weights` of experts [E, n, k] -> ``[E, n, k]`` in `dtype`, as
    `mxfp4.dequantize` computes it from the checkpoint's bytes."""
    w = weights.grouped()
    e, n, k = w.shape
    kp = 32 * w.scales.shape[-1]
    out = torch.empty(e, n, k, dtype=dtype, device=w.qweight.device)
    grid = (e, triton.cdiv(n, BLOCK_N), kp // BLOCK_K)
    _dequantize_kernel[grid](
        w.qweight.view(torch.uint8), w.scales, out, n, k, w.scales.shape[-2], kp,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
    )  # fmt: skip
    return out
