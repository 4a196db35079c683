"""The entry point for unquantized linear layers and LM heads: the one-token GEMV
(`gemv.dense_gemv`, Triton) for a single fp16/bf16 token on a Hopper GPU, ``F.linear``
otherwise.

The GEMV reads its first weights before its programmatic-dependent-launch wait, so a weight
passed here must not be written by a kernel of the same stream launched with PDL (model
parameters are not). One token and several tokens take different kernels, so a sequence's
logits can differ in the last bits with the batch it decodes in (as with cuBLAS's own choice
of kernel by shape)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantfw.kernels.common import cuda_capability, triton_available

#: compute capabilities the GEMV serves: measured on Hopper (H100); other GPUs keep cuBLAS
CAPABILITIES = ((9, 0),)

#: weights of at least this many elements (an LM head, a large MLP projection) take two
#: rows and 1024 inputs a step; smaller ones four rows and 512 (H100, 2026-11-25:
#: `benchmarks/probe_dense_gemv.py`: on GPT-OSS-20B's and Qwen3-8B's shapes the fastest of
#: eight configs or within 9% of it, and 1.05-1.45x faster than cuBLAS, 2.8x on a router)
LARGE_WEIGHT = 1 << 26


def gemv_config(N: int, K: int) -> dict:
    """The `dense_gemv` options for a one-token ``[N, K]`` weight."""
    if N * K >= LARGE_WEIGHT:
        return dict(block_n=2, block_k=1024, ctas_per_sm=8, warps=4)
    return dict(block_n=4, block_k=512, ctas_per_sm=8, warps=2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for an unquantized weight, through `dense_gemv` (configured by
    `gemv_config`) for one fp16/bf16 token on a Hopper GPU."""
    if (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.numel() == x.shape[-1]
        and weight.dtype == x.dtype
        and weight.device == x.device
        and weight.numel() > 0
        and weight.stride(-1) == 1
        and (
            bias is None
            or (bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == weight.shape[:1])
        )
        and cuda_capability(x.device) in CAPABILITIES
        and triton_available()
    ):
        from quantfw.kernels.dense.gemv import dense_gemv

        cfg = gemv_config(*weight.shape)
        return dense_gemv(x.reshape(1, -1), weight, bias, **cfg).view(*x.shape[:-1], -1)
    return F.linear(x, weight, bias)
