"""The GPU entry points of grouped expert GEMMs (MXFP4 or dense weights), chosen per device;
no Triton import here (the kernels load on first CUDA use).

* `moe_forward`: a whole MoE layer on this rank: tokens sorted by expert (`kernels.moe.sort`),
  W13 grouped GEMM (+ bias), the activation, W2 grouped GEMM (+ bias), weighted combine. No
  host synchronisation, so decode steps can be captured in CUDA graphs.
* `linear`: a dense MXFP4 layer as a group of one.

Weights are [E, N, K] (N outputs, K inputs): `DenseWeights` in the activation dtype, or
`Mxfp4Weights` as the checkpoint stores them (blocks [E, N, K/32, 16], scales [E, N, K/32]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantfw.kernels.common import triton_available
from quantfw.kernels.moe.sort import block_schedule, combine, single_group, sort_by_expert


@dataclass
class DenseWeights:
    weight: torch.Tensor  # [E, N, K]

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.weight.shape
        return e, n, k


@dataclass
class Mxfp4Weights:
    blocks: torch.Tensor  # [E, N, K/32, 16] uint8 ([N, K/32, 16] for a dense layer)
    scales: torch.Tensor  # [E, N, K/32] uint8

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, groups = self.scales.shape if self.scales.dim() == 3 else (1, *self.scales.shape)
        return e, n, groups * 32


ExpertWeights = DenseWeights | Mxfp4Weights


def gpu_available(x: torch.Tensor) -> bool:
    """Whether the Triton grouped GEMMs serve activations `x`: a CUDA tensor (fp16/bf16; fp32
    runs full-precision dots, for checks) on compute capability >= 8.0 with Triton installed."""
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 0) and triton_available()


def moe_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13: ExpertWeights,
    w2: ExpertWeights,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
    config: dict | None = None,
) -> torch.Tensor:
    """``sum_j w[t, j] * (act(x[t] @ W13[e].T + b13[e]) @ W2[e].T + b2[e])`` for x [T, H] and
    the experts ``e = topk_ids[t, j]``; `config` overrides the kernel configuration (tuning)."""
    from quantfw.kernels.mxfp4.triton import grouped_gemm
    from quantfw.kernels.mxfp4.triton import sort as fused

    num_experts = w13.shape[0]
    rows = topk_ids.numel()
    mx = isinstance(w13, Mxfp4Weights)
    cfg = config or grouped_gemm.default_config(rows, num_experts, *w13.shape[1:], mxfp4=mx)
    if cfg.get("DEQUANT") and mx:  # prefill: dense tensor-core GEMMs over dequantized experts
        w13, w2 = dequantize_dense(w13, x.dtype), dequantize_dense(w2, x.dtype)
    small = fused.align_fits(rows, num_experts)  # decode: one launch each for sort and combine
    if small:
        sort, plan = fused.align(topk_ids, num_experts, cfg["BLOCK_M"])
    else:
        sort = sort_by_expert(topk_ids, num_experts)
        plan = block_schedule(sort.m_indptr, rows, cfg["BLOCK_M"])
    h = grouped_gemm.grouped_gemm(x, w13, plan, bias=w13_bias, gather=sort.token_index, config=cfg)
    y = grouped_gemm.grouped_gemm(activation(h), w2, plan, bias=w2_bias, config=cfg)
    return fused.combine(y, sort, topk_weights) if small else combine(y, sort, topk_weights)


def dequantize_dense(w: ExpertWeights, dtype: torch.dtype) -> DenseWeights:
    """`w` as `DenseWeights` in `dtype` (MXFP4 weights decoded on the GPU)."""
    if isinstance(w, DenseWeights):
        return w
    from quantfw.kernels.mxfp4.triton.gemv import dequantize

    return DenseWeights(dequantize(w.blocks, w.scales, dtype))


def linear(x: torch.Tensor, w: Mxfp4Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) for one MXFP4 matrix W [N, K]."""
    from quantfw.kernels.mxfp4.triton import grouped_gemm

    x2 = x.reshape(-1, x.shape[-1])
    _, n, k = w.shape
    weights = Mxfp4Weights(w.blocks.unsqueeze(0), w.scales.unsqueeze(0))
    cfg = grouped_gemm.default_config(x2.shape[0], 1, n, k)
    if cfg.get("DEQUANT"):
        d = dequantize_dense(w, x.dtype).weight
        return torch.nn.functional.linear(x, d, bias)
    plan = single_group(x2.shape[0], cfg["BLOCK_M"], x.device)
    b = None if bias is None else bias.unsqueeze(0)
    return grouped_gemm.grouped_gemm(x2, weights, plan, bias=b, config=cfg).view(*x.shape[:-1], n)
