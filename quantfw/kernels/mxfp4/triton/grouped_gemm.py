"""Grouped GEMM over experts: ``out[r] = a[src(r)] @ W[e(r)].T (+ bias[e(r)])`` for rows sorted
by expert, with W dense ([E, N, K] in the activation dtype) or MXFP4 (the checkpoint's
``blocks [E, N, K/32, 16]`` and ``scales [E, N, K/32]``, used as stored: no repack).

One program computes a [BLOCK_M, BLOCK_N] tile of one expert's rows (`kernels.moe.BlockPlan`),
gathering activation rows through the token index on the W13 side. MXFP4 weights are decoded
into the dot's operand tile by tile in registers (`_decode_tile`): byte j of a row holds values
2j (low nibble) and 2j+1 (high nibble), joined back into k order; a code c becomes float32 bits
``sign << 31 | (c & 7) << 22`` (the E2M1 value times 2**-126) times 2**127, i.e. twice its value
exactly; the UE8M0 byte s (one per 32 values, broadcast in registers) becomes the float32 2**(s -
128) (a subnormal for s <= 1); their product rounds once, as `mxfp4.format.dequantize` does.
Activation tiles are loaded contiguously.

With ``SWAP`` the kernel computes the transposed tile ``W @ A.T``: the decoded weight tile is
the MMA's first operand, which Hopper's wgmma reads from registers and which fills wgmma's M >=
64 with BLOCK_N when only a few rows are routed to an expert; ``DOT_SCALED`` (with SWAP) lets
``tl.dot_scaled`` decode the E2M1 tile instead. `default_config` picks, by rows per expert, the
one-row GEMV of `gemv.py` (decode), this kernel (a few rows), or dequantized experts and the
dense kernel (prefill); `benchmarks/bench_mxfp4.py --sweep` times others, and
`benchmarks/mxfp4-lab-log.md` has the measurements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.moe.sort import BlockPlan


@triton.jit
def _e2m1_times_two(codes):
    """E2M1 codes (int32, 0..15) -> float32 holding twice their value, exactly."""
    bits = ((codes & 8) << 28) | ((codes & 7) << 22)
    return bits.to(tl.float32, bitcast=True) * 1.7014118346046923e38  # 2**127


@triton.jit
def _ue8m0_half(s):
    """UE8M0 bytes (int32) -> float32 2**(s - 128): exponent field s - 1, or a subnormal."""
    bits = tl.where(s >= 2, (s - 1) << 23, 1 << (21 + s))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_tile(packed, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K] weights from packed bytes [BLOCK_N, BLOCK_K / 2] and their
    UE8M0 bytes [BLOCK_N, BLOCK_K / 32]: the low and high nibble of byte j are joined as k = 2j
    and 2j + 1, and each run of 32 k shares one scale (broadcast in registers)."""
    p = packed.to(tl.int32)
    w = tl.join(_e2m1_times_two(p & 15), _e2m1_times_two(p >> 4))  # [BN, BK / 2, 2]
    w = tl.reshape(w, [BLOCK_N, BLOCK_K // 32, 32]) * _ue8m0_half(s.to(tl.int32))[:, :, None]
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _dot_scaled(acc, a, packed, s):
    """acc [BLOCK_N, BLOCK_M] + W @ a.T through ``tl.dot_scaled``, the weight tile (E2M1 packed
    along K, low nibble first, as the checkpoint stores it) as the scaled left operand: Triton
    decodes it and applies the UE8M0 scales itself. (The unswapped form, with the weights as the
    right operand, gave wrong results on sm_90 with Triton 3.6.)"""
    fp4: tl.constexpr = tl.constexpr("e2m1")
    if a.dtype == tl.float16:
        fmt: tl.constexpr = tl.constexpr("fp16")
    else:
        fmt: tl.constexpr = tl.constexpr("bf16")
    return tl.dot_scaled(packed, s, fp4, tl.trans(a), None, fmt, acc)


@triton.jit
def _mma(acc, a, w, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ w.T ([BLOCK_M, BLOCK_N]), or with SWAP acc + w @ a.T ([BLOCK_N, BLOCK_M]): the
    weight tile, decoded in registers, is then the MMA's first operand (Hopper's wgmma reads it
    from registers and needs M >= 64, which BLOCK_N gives when few rows are routed)."""
    if SWAP:
        lhs, rhs = w, tl.trans(a)
    else:
        lhs, rhs = a, tl.trans(w)
    if IEEE:
        acc = tl.dot(lhs, rhs, acc, input_precision="ieee")
    else:
        acc = tl.dot(lhs, rhs, acc)
    return acc


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    gather_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    block_expert_ptr,
    block_row_ptr,
    m_indptr_ptr,
    N,
    K,
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    MXFP4: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    SWAP: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    e = expert.to(tl.int64)
    row0 = tl.load(block_row_ptr + pid_m)
    row_end = tl.load(m_indptr_ptr + e + 1).to(tl.int32)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    if GATHER:
        src = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    a_rows = a_ptr + src[:, None] * stride_am
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MXFP4:
        HALF: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // 32
        offs_k = tl.arange(0, BLOCK_K)
        j = tl.arange(0, HALF)
        g = tl.arange(0, GROUPS)
        w_rows = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
        s_rows = s_ptr + e * stride_se + offs_n[:, None] * stride_sn
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)
            packed = tl.load(
                w_rows + (k0 // 2 + j)[None, :],
                mask=n_mask[:, None] & (k0 + 2 * j < K)[None, :],
                other=0,
            )
            s = tl.load(
                s_rows + (k0 // 32 + g)[None, :],
                mask=n_mask[:, None] & (k0 + 32 * g < K)[None, :],
                other=0,
            )
            if DOT_SCALED:
                acc = _dot_scaled(acc, a, packed, s)
            else:
                w = _decode_tile(packed, s, BLOCK_N, BLOCK_K).to(a.dtype)
                acc = _mma(acc, a, w, SWAP, IEEE)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc = _mma(acc, a, w, SWAP, IEEE)
    if SWAP:
        acc = tl.trans(acc)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e * stride_be + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


#: rows per expert up to which `default_config` picks the CUDA-core GEMV (decode), and from
#: which it dequantizes the experts for a dense tensor-core grouped GEMM (prefill)
GEMV_MAX_ROWS_PER_EXPERT = 1.5
DEQUANT_MIN_ROWS_PER_EXPERT = 64


def default_config(rows: int, num_experts: int, n: int, k: int, mxfp4: bool = True) -> dict:
    """A kernel configuration for `rows` sorted rows over `num_experts` experts of [n, k]
    (picked by rows per expert from the H200 sweep in benchmarks/results/mxfp4/;
    `benchmarks/bench_mxfp4.py --sweep` times others). ``GEMV``: `gemv._grouped_gemv_kernel`,
    one row per block; ``DEQUANT``: MXFP4 experts are dequantized, then the dense kernel runs."""
    per_expert = rows / max(1, min(rows, num_experts))
    if mxfp4 and per_expert <= GEMV_MAX_ROWS_PER_EXPERT:
        return {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3,
                "GEMV": True}  # fmt: skip
    if per_expert <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
                "SWAP": True}  # fmt: skip
    if per_expert < DEQUANT_MIN_ROWS_PER_EXPERT:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3,
                "SWAP": True}  # fmt: skip
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3,
            "DEQUANT": mxfp4}  # fmt: skip


def grouped_gemm(
    a: torch.Tensor,
    weights,
    plan: BlockPlan,
    *,
    bias: torch.Tensor | None = None,
    gather: torch.Tensor | None = None,
    config: dict,
) -> torch.Tensor:
    """out [plan.num_rows, N] in a's dtype: row r of expert e is ``a[gather[r] if gather is not
    None else r] @ W[e].T + bias[e]``. `weights` is a `grouped.DenseWeights` or
    `grouped.Mxfp4Weights`; `config` holds BLOCK_M (equal to the plan's), BLOCK_N, BLOCK_K
    (a multiple of 32 for MXFP4), num_warps, num_stages and optionally SWAP."""
    from quantfw.kernels.mxfp4.grouped import Mxfp4Weights

    num_experts, n, k = weights.shape
    if a.shape[-1] != k or a.stride(-1) != 1:
        raise ValueError(f"grouped_gemm: activations {tuple(a.shape)} do not match K={k}")
    if config["BLOCK_M"] != plan.block_m:
        raise ValueError(f"grouped_gemm: BLOCK_M {config['BLOCK_M']} != plan's {plan.block_m}")
    out = torch.empty(plan.num_rows, n, dtype=a.dtype, device=a.device)
    if plan.num_rows == 0 or plan.num_blocks == 0:
        return out
    mx = isinstance(weights, Mxfp4Weights)
    if mx:
        w = weights.blocks.reshape(num_experts, n, k // 2)
        s = weights.scales.reshape(num_experts, n, k // 32)
        if config["BLOCK_K"] % 32:
            raise ValueError(
                f"grouped_gemm: MXFP4 needs BLOCK_K % 32 == 0, got {config['BLOCK_K']}"
            )
    else:
        w = s = weights.weight
    if w.stride(-1) != 1 or s.stride(-1) != 1:
        raise ValueError("grouped_gemm: weights need a unit stride along K")
    if config.get("DOT_SCALED") and not config.get("SWAP"):
        raise ValueError(
            "grouped_gemm: DOT_SCALED needs SWAP (the weights as the scaled left operand)"
        )
    if config.get("GEMV"):
        if not mx or plan.block_m != 1:
            raise ValueError("grouped_gemm: GEMV needs MXFP4 weights and a plan of one-row blocks")
        from quantfw.kernels.mxfp4.triton.gemv import grouped_gemv

        grouped_gemv(a, w, s, plan, bias, gather, out, config)
        return out
    grid = (plan.num_blocks, triton.cdiv(n, config["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a,
        gather if gather is not None else plan.block_row,
        w,
        s,
        bias if bias is not None else out,
        out,
        plan.block_expert,
        plan.block_row,
        plan.m_indptr,
        n,
        k,
        num_experts,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        s.stride(0),
        s.stride(1),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        MXFP4=mx,
        GATHER=gather is not None,
        HAS_BIAS=bias is not None,
        IEEE=a.dtype == torch.float32,
        SWAP=config.get("SWAP", False),
        DOT_SCALED=mx and config.get("DOT_SCALED", False) and a.dtype != torch.float32,
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out
