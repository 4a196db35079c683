"""Few-row MXFP4 kernels beside the grouped GEMM (`grouped_gemm.py`):

* ``_grouped_gemv_kernel``: one sorted row per program and BLOCK_N output columns of its
  expert, on CUDA cores. At decode an expert sees about one row, so a tensor-core tile would be
  mostly padding, and the decoded weights would need a register-to-MMA-layout shuffle per tile.
  Here the packed bytes stay in their load layout: the low nibbles multiply the even inputs and
  the high nibbles the odd inputs, each scale group's 16 bytes are scaled by one broadcast
  factor, and the products accumulate per column and lane until one reduction at the end.
* ``_dequantize_kernel``: whole experts to the activation dtype (the prefill path: a dense
  grouped GEMM then runs on tensor cores).

Decoding is `grouped_gemm._e2m1_times_two` / `_ue8m0_half`, the functions the interpreter test
checks bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.moe.sort import BlockPlan
from quantfw.kernels.mxfp4.triton.grouped_gemm import _decode_tile, _e2m1_times_two, _ue8m0_half


@triton.jit
def _grouped_gemv_kernel(
    a_ptr, gather_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, block_expert_ptr, block_row_ptr,
    N, K, num_experts, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """grid (plan blocks of one row, N / BLOCK_N): out[r, n] = a[src(r)] . W[e(r), n] (+ bias)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    e = expert.to(tl.int64)
    row = tl.load(block_row_ptr + pid_m).to(tl.int64)
    if GATHER:
        src = tl.load(gather_ptr + row).to(tl.int64)
    else:
        src = row
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    j = tl.arange(0, HALF)
    g = tl.arange(0, GROUPS)
    w_rows = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
    s_rows = s_ptr + e * stride_se + offs_n[:, None] * stride_sn
    a_row = a_ptr + src * stride_am
    acc = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + 2 * j < K
        p = tl.load(
            w_rows + (k0 // 2 + j)[None, :], mask=n_mask[:, None] & k_ok[None, :], other=0
        ).to(tl.int32)
        s = tl.load(
            s_rows + (k0 // 32 + g)[None, :],
            mask=n_mask[:, None] & (k0 + 32 * g < K)[None, :],
            other=0,
        )
        a_even = tl.load(a_row + k0 + 2 * j, mask=k_ok, other=0.0).to(tl.float32)
        a_odd = tl.load(a_row + k0 + 2 * j + 1, mask=k_ok, other=0.0).to(tl.float32)
        pair = _e2m1_times_two(p & 15) * a_even[None, :] + _e2m1_times_two(p >> 4) * a_odd[None, :]
        scaled = tl.reshape(pair, [BLOCK_N, GROUPS, 16]) * _ue8m0_half(s.to(tl.int32))[:, :, None]
        acc += tl.reshape(scaled, [BLOCK_N, HALF])
    acc = tl.sum(acc, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, out_ptr, rows, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """grid (rows / BLOCK_N, K / BLOCK_K): out [rows, K] from blocks [rows, K/2], scales [rows, K/32]."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    j = tl.arange(0, BLOCK_K // 2)
    g = tl.arange(0, BLOCK_K // 32)
    n_ok = (n < rows)[:, None]
    nl = n.to(tl.int64)[:, None]
    packed = tl.load(w_ptr + nl * (K // 2) + k0 // 2 + j[None, :], mask=n_ok, other=0)
    s = tl.load(s_ptr + nl * (K // 32) + k0 // 32 + g[None, :], mask=n_ok, other=0)
    w = _decode_tile(packed, s, BLOCK_N, BLOCK_K)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + nl * K + k[None, :], w.to(out_ptr.dtype.element_ty), mask=n_ok)


def grouped_gemv(a, w, s, plan: BlockPlan, bias, gather, out, config: dict) -> None:
    """`grouped_gemm` for a plan of one-row blocks (``plan.block_m == 1``), MXFP4 weights
    ``w [E, N, K/2]`` / ``s [E, N, K/32]``; writes `out`."""
    num_experts, n, half = w.shape
    grid = (plan.num_blocks, triton.cdiv(n, config["BLOCK_N"]))
    _grouped_gemv_kernel[grid](
        a, gather if gather is not None else plan.block_row, w, s,
        bias if bias is not None else out, out, plan.block_expert, plan.block_row,
        n, 2 * half, num_experts, a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        GATHER=gather is not None, HAS_BIAS=bias is not None,
        BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 ``blocks [..., N, K/32, 16]`` / ``scales [..., N, K/32]`` -> ``[..., N, K]`` in
    `dtype`, as `mxfp4.dequantize` computes it."""
    *lead, groups, _ = blocks.shape
    k = 32 * groups
    rows = blocks[..., 0, 0].numel()
    out = torch.empty(*lead, k, dtype=dtype, device=blocks.device)
    block_n, block_k = 64, (64 if k % 64 == 0 else 32)
    grid = (triton.cdiv(rows, block_n), k // block_k)
    _dequantize_kernel[grid](
        blocks.contiguous(), scales.contiguous(), out, rows, k,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out
