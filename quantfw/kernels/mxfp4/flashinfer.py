"""Blackwell (SM100+): MoE experts through FlashInfer's ``group_gemm_mxfp4_nt_groupwise``
(activations quantized to MXFP8 by ``mxfp8_quantize``, MXFP4 weights), with the layout rules of
`flashinfer_layout`. Not run in this project's CI or on its GPUs (no Blackwell); the layout
transforms are tested on the CPU, this module only makes the calls."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantfw.kernels.moe.sort import combine, sort_by_expert
from quantfw.kernels.mxfp4 import flashinfer_layout as fl


@functools.cache
def _ops():
    from flashinfer import mxfp8_quantize
    from flashinfer.gemm import group_gemm_mxfp4_nt_groupwise

    return mxfp8_quantize, group_gemm_mxfp4_nt_groupwise


def cuda_with(
    device: torch.device, capability_ok: Callable[[tuple[int, int]], bool], ops: Callable
) -> bool:
    """A CUDA `device` whose compute capability passes `capability_ok`, with FlashInfer's
    `ops` (a function that imports them) importable."""
    if device.type != "cuda" or not capability_ok(torch.cuda.get_device_capability(device)):
        return False
    try:
        ops()
    except ImportError:
        return False
    return True


def available(device: torch.device) -> bool:
    """A Blackwell GPU with FlashInfer's MXFP4 grouped GEMM importable."""
    return cuda_with(device, lambda cap: cap[0] >= 10, _ops)


@dataclass
class FlashInferWeights:
    """Experts' MXFP4 weights padded (N % 8, K % 128) with 128x4-swizzled scales."""

    b: torch.Tensor  # [E, N_pad, K_pad / 2] uint8
    b_scale: torch.Tensor  # [E, round_up(N_pad, 128), K_pad / 32] uint8, swizzled
    n: int
    k: int

    @classmethod
    def prepare(cls, blocks: torch.Tensor, scales: torch.Tensor) -> FlashInferWeights:
        b, s = fl.pad_weights(blocks, scales)
        return cls(b, fl.swizzle_scales(s), blocks.shape[1], blocks.shape[2] * 32)


def grouped_gemm(
    x: torch.Tensor,
    w: FlashInferWeights,
    m_indptr: torch.Tensor,
    expert_of_row: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Rows x [R, K] sorted by expert -> [R, N]: row r times expert ``expert_of_row[r]``."""
    mxfp8_quantize, group_gemm = _ops()
    rows, num_experts = x.shape[0], w.b.shape[0]
    k_pad = w.b.shape[2] * 2
    padded_indptr, dest = fl.pad_group_rows(m_indptr, expert_of_row, fl.ALIGN_M)
    total = fl.round_up(fl.padded_rows_bound(rows, num_experts, fl.ALIGN_M), fl.ALIGN_M)
    a = x.new_zeros(total, k_pad)
    a[dest, : w.k] = x
    a_fp8, a_sf = mxfp8_quantize(a, False, 32)
    group_of_row = torch.searchsorted(
        padded_indptr[1:], torch.arange(total, device=x.device), right=True
    )
    a_scale = fl.swizzle_grouped_scales(a_sf.view(total, k_pad // 32), padded_indptr, group_of_row)
    out = group_gemm(
        a_fp8, w.b, a_scale, w.b_scale, padded_indptr.to(torch.int32), out_dtype=x.dtype
    )
    y = out[dest, : w.n]
    return y if bias is None else y + bias[expert_of_row]


def moe_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13: FlashInferWeights,
    w2: FlashInferWeights,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`grouped.moe_forward` with FlashInfer's GEMMs."""
    sort = sort_by_expert(topk_ids, w13.b.shape[0])
    h = grouped_gemm(x[sort.token_index], w13, sort.m_indptr, sort.expert_of_row, w13_bias)
    y = grouped_gemm(activation(h), w2, sort.m_indptr, sort.expert_of_row, w2_bias)
    return combine(y, sort, topk_weights)
