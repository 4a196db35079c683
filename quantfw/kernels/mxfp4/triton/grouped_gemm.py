"""Grouped GEMM over experts: ``out[r] = a[src(r)] @ W[e(r)].T (+ bias[e(r)])`` for rows sorted
by expert, with W dense ([E, N, K] in the activation dtype) or MXFP4 in the runtime layout of
`mxfp4.layout` (``qweight`` read as bytes ``[E, N_pad, K_pad / 2]``, ``scales [E, N_pad,
K_pad / 32]``).

One program computes a [BLOCK_M, BLOCK_N] tile of one expert's rows (`kernels.moe.BlockPlan`),
gathering activation rows through the token index on the W13 side. MXFP4 weights are decoded
into the dot's operand tile by tile in registers (`_decode_tile`): a tile of BLOCK_K inputs is
BLOCK_K / 128 quads of 64 contiguous bytes, decoded in their byte order (kbit's ``quad_k``
order; the activations are loaded in the same order, so the dot is unchanged); a code c becomes
float32 bits ``sign << 31 | (c & 7) << 22`` (the E2M1 value times 2**-126) times 2**127, i.e.
twice its value exactly; the UE8M0 byte s (one per 32 values, broadcast in registers) becomes
the float32 2**(s - 128) (a subnormal for s <= 1); their product rounds once, as
`mxfp4.format.dequantize` does.

With ``SWAP`` the kernel computes the transposed tile ``W @ A.T``: the decoded weight tile is
the MMA's first operand, which Hopper's wgmma reads from registers and which fills wgmma's M >=
64 with BLOCK_N when only a few rows are routed to an expert. ``LUT`` configs run the
codebook-lookup mma kernel (`kbit/triton/mma.py`) instead. `default_config` picks, by rows per
expert, LUT (decode), this kernel (a few rows), or dequantized experts and the dense kernel
(prefill); `benchmarks/bench_mxfp4.py --sweep` times others, and `benchmarks/mxfp4-lab-log.md`
has the measurements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.kbit.triton.kernels import quad_k
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
    """float32 [BLOCK_N, BLOCK_K] weights, in ``quad_k`` order, from packed bytes [BLOCK_N,
    BLOCK_K / 2] (whole quads) and their UE8M0 bytes [BLOCK_N, BLOCK_K / 32]: byte ``64 q + 16 j
    + 4 r + b`` holds inputs ``128 q + 32 r + 8 j + 2 b`` (low nibble) and ``+ 1``, of block
    ``4 q + r``, whose scale is broadcast in registers."""
    Q: tl.constexpr = BLOCK_K // 128
    p = packed.to(tl.int32)
    w = tl.join(_e2m1_times_two(p & 15), _e2m1_times_two(p >> 4))  # [BN, BK / 2, 2]
    scale = tl.reshape(_ue8m0_half(s.to(tl.int32)), [BLOCK_N, Q, 1, 4, 1])
    w = tl.reshape(w, [BLOCK_N, Q, 4, 4, 8]) * scale
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


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
    KP,  # MXFP4: inputs per weight row, padded (G_pad * 32)
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
        offs_k = quad_k(BLOCK_K, 4)  # the decoded tile's input order
        j = tl.arange(0, HALF)
        g = tl.arange(0, GROUPS)
        w_rows = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
        s_rows = s_ptr + e * stride_se + offs_n[:, None] * stride_sn
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)
            packed = tl.load(
                w_rows + (k0 // 2 + j)[None, :],
                mask=n_mask[:, None] & (k0 + 2 * j < KP)[None, :],
                other=0,
            )
            s = tl.load(
                s_rows + (k0 // 32 + g)[None, :],
                mask=n_mask[:, None] & (k0 + 32 * g < KP)[None, :],
                other=0,
            )
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


#: rows per expert up to which `default_config` picks the lookup mma kernel (decode), and
#: from which it dequantizes the experts for a dense tensor-core grouped GEMM (prefill)
LUT_MAX_ROWS_PER_EXPERT = 16
DEQUANT_MIN_ROWS_PER_EXPERT = 64
#: sm_90, bf16 activations on MXFP4 experts past the lookup kernel: the wgmma kernel
#: (`triton.wgmma`: weights decoded into wgmma's register operand), 256-token tiles from
#: WIDE rows per expert (64 below), chunks of 64 tokens below WHOLE rows
WGMMA_WIDE_ROWS_PER_EXPERT = 128
WGMMA_WHOLE_ROWS_PER_EXPERT = 512
#: rows per expert from which prefill's dense tiles are 256 columns wide on sm_90
WIDE_MIN_ROWS_PER_EXPERT = 512
#: the lookup mma kernel's options (`kbit.triton.mma.kbit_mma_matmul`) at decode
LUT_OPTIONS = {"copies": 32, "ctas_per_sm": 3, "chunk": 4}
#: sm_90, grouped 16-row blocks: weights staged by TMA under kbit's 16-token register cap
#: (`kbit.triton.mma.TILE16_STAGED_MAXNREG`), so that the 3 CTAs an SM of `LUT_OPTIONS` fit
#: (unstaged the tile takes 222 registers, 2 an SM): benchmarks/mxfp4-lab-log.md §32
LUT16_STAGED_OPTIONS = {"stage_by_tma": True, "maxnreg": 168}


def default_config(
    rows: int,
    num_experts: int,
    n: int,
    k: int,
    mxfp4: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    hopper: bool = False,
) -> dict:
    """A kernel configuration for `rows` sorted rows of `dtype` over `num_experts` experts of
    [n, k] (picked by rows per expert from the H200 measurements in benchmarks/results/mxfp4/;
    `benchmarks/bench_mxfp4.py --sweep` times others). ``LUT``: the lookup mma kernel (MXFP4,
    fp16/bf16), row blocks of 8 or 16 (grouped 16-row blocks staged on sm_90:
    `LUT16_STAGED_OPTIONS`); ``WGMMA``: the Hopper kernel of `triton.wgmma` (MXFP4, bf16,
    sm_90); ``DEQUANT``: MXFP4 experts are dequantized, then the dense kernel runs. `hopper`:
    the device is sm_90."""
    per_expert = rows / max(1, min(rows, num_experts))
    lut = mxfp4 and dtype in (torch.float16, torch.bfloat16)
    if lut and per_expert <= 8:
        return {"BLOCK_M": 8, "LUT": True, **LUT_OPTIONS}
    if lut and per_expert <= LUT_MAX_ROWS_PER_EXPERT:
        staged = LUT16_STAGED_OPTIONS if hopper and num_experts > 1 else {}
        return {"BLOCK_M": 16, "LUT": True, **LUT_OPTIONS, **staged}
    if hopper and mxfp4 and dtype == torch.bfloat16:
        # past the lookup kernel on sm_90: the wgmma kernel (H100, GPT-OSS-20B's experts,
        # benchmarks/mxfp4-lab-log.md §16-17): 64-token tiles below 128 rows per expert, then
        # 256-token tiles whose 64-row chunks past an expert's rows are skipped, whole from 512
        if per_expert < WGMMA_WIDE_ROWS_PER_EXPERT:
            return {"BLOCK_M": 64, "WGMMA": True, "stages": 4}
        chunk = 256 if per_expert >= WGMMA_WHOLE_ROWS_PER_EXPERT else 64
        return {"BLOCK_M": 256, "WGMMA": True, "stages": 3, "chunk": chunk}
    if per_expert <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
                "SWAP": True}  # fmt: skip
    if per_expert < DEQUANT_MIN_ROWS_PER_EXPERT:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3,
                "SWAP": True}  # fmt: skip
    # sm_90 from 512 rows per expert: 256-column tiles (144 KB of shared memory) were 3% (512
    # rows) and 14% (1024) faster than 128 on GPT-OSS-20B's experts, 2% slower at 64-256 rows
    # (benchmarks/mxfp4-lab-log.md §15)
    wide = hopper and per_expert >= WIDE_MIN_ROWS_PER_EXPERT
    return {"BLOCK_M": 128, "BLOCK_N": 256 if wide else 128, "BLOCK_K": 64, "num_warps": 8,
            "num_stages": 3, "DEQUANT": mxfp4}  # fmt: skip


_LUTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def e2m1_lookup_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The lookup mma kernel's table of the E2M1 values (per byte, its two values in `dtype`),
    made once per device and dtype (on the CPU, copied synchronously: the kernel reads it
    before its PDL wait)."""
    key = (torch.device(device), dtype)
    if key not in _LUTS:
        from quantfw.kernels.kbit.triton.mma import lookup_table
        from quantfw.kernels.mxfp4.format import FP4_VALUES

        values = torch.tensor(FP4_VALUES, dtype=torch.float32)
        _LUTS[key] = lookup_table(values, 4, dtype, factor=1.0).to(device)
    return _LUTS[key]


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
    `grouped.Mxfp4Weights` (experts [E, ...]); `config` holds BLOCK_M (equal to the plan's) and
    either ``LUT`` with the lookup kernel's options, or BLOCK_N, BLOCK_K (a multiple of 128 for
    MXFP4), num_warps, num_stages and optionally SWAP."""
    from quantfw.kernels.mxfp4.grouped import Mxfp4Weights

    num_experts, n, k = weights.shape
    if a.shape[-1] != k or a.stride(-1) != 1:
        raise ValueError(f"grouped_gemm: activations {tuple(a.shape)} do not match K={k}")
    if config["BLOCK_M"] != plan.block_m:
        raise ValueError(f"grouped_gemm: BLOCK_M {config['BLOCK_M']} != plan's {plan.block_m}")
    mx = isinstance(weights, Mxfp4Weights)
    if config.get("LUT"):
        if not mx or a.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"grouped_gemm: LUT needs MXFP4 weights and fp16/bf16 activations, got "
                f"{type(weights).__name__} and {a.dtype}"
            )
        from quantfw.kernels.kbit.triton.mma import grouped_lut_mma

        options = {key: v for key, v in config.items() if key not in ("BLOCK_M", "LUT")}
        return grouped_lut_mma(
            a, weights.qweight, weights.scales, e2m1_lookup_table(a.device, a.dtype), n, plan,
            gather=gather, bias=bias, ue8m0=True, owner=weights, **options,
        )  # fmt: skip
    out = torch.empty(plan.num_rows, n, dtype=a.dtype, device=a.device)
    if plan.num_rows == 0 or plan.num_blocks == 0:
        return out
    if mx:
        w = weights.qweight.view(torch.uint8)  # [E, N_pad, K_pad / 2]
        s = weights.scales
        kp = 2 * w.shape[-1]
        if config["BLOCK_K"] % 128:
            raise ValueError(
                f"grouped_gemm: MXFP4 needs BLOCK_K % 128 == 0 (whole quads of blocks), got "
                f"{config['BLOCK_K']}"
            )
    else:
        w = s = weights.weight
        kp = k
    if w.stride(-1) != 1 or s.stride(-1) != 1:
        raise ValueError("grouped_gemm: weights need a unit stride along K")
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
        kp,
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
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out
