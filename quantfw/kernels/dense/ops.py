"""The entry point for unquantized linear layers and LM heads: ``F.linear``, or the one-token
GEMV (`gemv.dense_gemv`, Triton) at the shapes where it beats cuBLAS."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantfw.kernels.common import triton_available

#: one-token shapes the GEMV serves (H100, `benchmarks/probe_dense_gemv.py`, 2026-11-25): a
#: router-sized output (cuBLAS ~6 us, this kernel ~2.3 us) and vocabulary-sized weights (an
#: LM head, ~5% under cuBLAS); the attention and MLP projections stay with cuBLAS, which is
#: within 10% of this kernel or faster there.
SMALL_N = 1024
LARGE_WEIGHT = 1 << 28  # elements


def gemv_config(N: int, K: int) -> dict | None:
    """The `dense_gemv` options for a one-token ``[N, K]`` weight, or None for cuBLAS."""
    if N <= SMALL_N:
        return dict(block_n=16, block_k=256, ctas_per_sm=8)
    if N * K >= LARGE_WEIGHT:
        return dict(block_n=8, block_k=512, ctas_per_sm=8)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for an unquantized weight, through `dense_gemv` for one fp16/bf16 token on
    CUDA at the shapes `gemv_config` names."""
    if (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.numel() == x.shape[-1]
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and (bias is None or bias.shape == weight.shape[:1])
    ):
        cfg = gemv_config(*weight.shape)
        if cfg is not None and triton_available():
            from quantfw.kernels.dense.gemv import dense_gemv

            return dense_gemv(x.reshape(1, -1), weight, bias, **cfg).view(*x.shape[:-1], -1)
    return F.linear(x, weight, bias)
