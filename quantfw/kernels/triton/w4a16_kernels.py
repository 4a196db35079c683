"""Triton W4A16 kernels over the PackedW4 layout (see quantfw/kernels/w4a16.py).

Three paths (chosen per M bucket and shape by a cached config, see tune()):

* ``_w4a16_gemv_kernel`` (M = 1 by default, up to 4 if tuned): CUDA-core split-K GEMV; each
  program dequantizes a [BLOCK_K, BLOCK_N] tile once and reuses it for every activation row.
* ``_w4a16_mm_kernel`` (otherwise below M = 256): tensor-core tiled GEMM (``tl.dot``: mma on Ampere, wgmma on
  Hopper) with the weight tile dequantized in registers; split-K for skinny shapes.
* ``_w4a16_dequant_kernel`` + cuBLAS (M >= 256 by default): dequantize into a transient
  [K, N] buffer (freed after the call; never kept), then ``torch.mm``.

Dequantization: a word holds columns 2j and 2j+1 in nibbles j and j+4.  ``(w >> 4j) & 0x000F000F
| 0x64006400`` (one ``lop3``) is the fp16 pair (1024 + q_2j, 1024 + q_2j+1); subtracting the
pair (1024 + z) is exact, then one multiply by the scale pair (``sub.f16x2``, ``mul.f16x2``;
bf16 uses 128 = 0x4300 and the bf16x2 forms).  Without inline PTX the same values come out of
plain integer/float ops (``USE_ASM=False``, also what the Triton CPU interpreter runs).

Split-K partial sums are combined with atomics into an fp32 workspace (fp16 atomics lost
precision), then cast.  Nothing here synchronizes with the host, so a call is safe under CUDA
graph capture once its config has been compiled (warm up before capturing).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _pair(wj, zpj, spj, IS_BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """wj: int32 words already shifted right by 4j; zpj: int32 (zero-word >> 4j);
    spj: int32 bits of the scale pair (s_2j, s_2j+1).  Returns the two dequantized columns."""
    if USE_ASM:
        if IS_BF16:
            zm = (zpj & 0x000F000F) | 0x43004300
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000f000f, 0x43004300, 0xea; "
                "sub.rn.bf16x2 t, t, $3; mul.rn.bf16x2 t, t, $4; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r,r",
                [wj, zm, spj],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=1,
            )
        else:
            zm = (zpj & 0x000F000F) | 0x64006400
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000f000f, 0x64006400, 0xea; "
                "sub.f16x2 t, t, $3; mul.f16x2 t, t, $4; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r,r",
                [wj, zm, spj],
                dtype=(tl.float16, tl.float16),
                is_pure=True,
                pack=1,
            )
    else:
        if IS_BF16:
            dt = tl.bfloat16
        else:
            dt = tl.float16
        s_lo = (spj & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
        s_hi = ((spj >> 16) & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
        q_lo = (wj & 0xF) - (zpj & 0xF)
        q_hi = ((wj >> 16) & 0xF) - ((zpj >> 16) & 0xF)
        lo = (q_lo.to(tl.float32) * s_lo).to(dt)
        hi = (q_hi.to(tl.float32) * s_hi).to(dt)
    return lo, hi


@triton.jit
def _dequant8(w, zw, sc_row_ptr, offs_n8, mask_n8, IS_BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """w: int32 [BK, BN8]; zw: int32 [BN8] zero words of this group; sc_row_ptr: int32 view of
    this group's scale row.  Returns the 8 column tensors [BK, BN8] (column 8c + j)."""
    s0 = tl.load(sc_row_ptr + offs_n8 * 4 + 0, mask=mask_n8, other=0)[None, :]
    s1 = tl.load(sc_row_ptr + offs_n8 * 4 + 1, mask=mask_n8, other=0)[None, :]
    s2 = tl.load(sc_row_ptr + offs_n8 * 4 + 2, mask=mask_n8, other=0)[None, :]
    s3 = tl.load(sc_row_ptr + offs_n8 * 4 + 3, mask=mask_n8, other=0)[None, :]
    z = zw[None, :]
    o0, o1 = _pair(w, z, s0, IS_BF16, USE_ASM)
    o2, o3 = _pair(w >> 4, z >> 4, s1, IS_BF16, USE_ASM)
    o4, o5 = _pair(w >> 8, z >> 8, s2, IS_BF16, USE_ASM)
    o6, o7 = _pair(w >> 12, z >> 12, s3, IS_BF16, USE_ASM)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _interleave8(o0, o1, o2, o3, o4, o5, o6, o7, R: tl.constexpr, BN: tl.constexpr):
    """8 tensors [R, BN/8] (column 8c + j in o_j) -> [R, BN] in natural column order."""
    t = tl.join(
        tl.join(tl.join(o0, o4), tl.join(o2, o6)),
        tl.join(tl.join(o1, o5), tl.join(o3, o7)),
    )
    return tl.reshape(t, (R, BN))


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,
    qw_ptr,
    qz_ptr,
    sc_ptr,  # int32 view of the scales, [n_groups, N // 2]
    bias_ptr,
    out_ptr,
    M,
    N,
    N8,  # N // 8, passed so that Triton sees its divisibility and vectorizes loads
    K,
    G,
    k_per_split,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_BF16: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    BN8: tl.constexpr = BLOCK_N // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n8 = pid_n * BN8 + tl.arange(0, BN8)
    mask_n8 = offs_n8 < N8
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    k_start = pid_k * k_per_split

    a0 = tl.zeros((BLOCK_M, BN8), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_M, BN8), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_M, BN8), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_M, BN8), dtype=tl.float32)
    a4 = tl.zeros((BLOCK_M, BN8), dtype=tl.float32)
    a5 = tl.zeros((BLOCK_M, BN8), dtype=tl.float32)
    a6 = tl.zeros((BLOCK_M, BN8), dtype=tl.float32)
    a7 = tl.zeros((BLOCK_M, BN8), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(
            qw_ptr + offs_k[:, None] * N8 + offs_n8[None, :],
            mask=mask_k[:, None] & mask_n8[None, :],
            other=0,
        )
        g = k0 // G
        mask_g = mask_n8 & (k0 < K)
        zw = tl.load(qz_ptr + g * N8 + offs_n8, mask=mask_g, other=0)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        x3 = x[:, :, None]
        o0, o1, o2, o3, o4, o5, o6, o7 = _dequant8(
            w, zw, sc_ptr + g * (N8 * 4), offs_n8, mask_g, IS_BF16, USE_ASM
        )
        a0 += tl.sum(x3 * o0.to(tl.float32)[None, :, :], axis=1)
        a1 += tl.sum(x3 * o1.to(tl.float32)[None, :, :], axis=1)
        a2 += tl.sum(x3 * o2.to(tl.float32)[None, :, :], axis=1)
        a3 += tl.sum(x3 * o3.to(tl.float32)[None, :, :], axis=1)
        a4 += tl.sum(x3 * o4.to(tl.float32)[None, :, :], axis=1)
        a5 += tl.sum(x3 * o5.to(tl.float32)[None, :, :], axis=1)
        a6 += tl.sum(x3 * o6.to(tl.float32)[None, :, :], axis=1)
        a7 += tl.sum(x3 * o7.to(tl.float32)[None, :, :], axis=1)

    acc = _interleave8(a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M, BLOCK_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=mask_n & (pid_k == 0), other=0.0).to(tl.float32)
        acc += b[None, :]
    optrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    omask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:
        tl.atomic_add(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask, sem="relaxed")
    else:
        tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _w4a16_mm_kernel(
    x_ptr,
    qw_ptr,
    qz_ptr,
    sc_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    N8,  # N // 8, passed so that Triton sees its divisibility and vectorizes loads
    K,
    G,
    k_per_split,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ATOMIC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_BF16: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    BN8: tl.constexpr = BLOCK_N // 8
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_rows)
    pid_n = (pid % num_in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_n8 = pid_n * BN8 + tl.arange(0, BN8)
    mask_n8 = offs_n8 < N8
    k_start = pid_k * k_per_split

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            qw_ptr + offs_k[:, None] * N8 + offs_n8[None, :],
            mask=mask_k[:, None] & mask_n8[None, :],
            other=0,
        )
        g = k0 // G
        mask_g = mask_n8 & (k0 < K)
        zw = tl.load(qz_ptr + g * N8 + offs_n8, mask=mask_g, other=0)
        o0, o1, o2, o3, o4, o5, o6, o7 = _dequant8(
            w, zw, sc_ptr + g * (N8 * 4), offs_n8, mask_g, IS_BF16, USE_ASM
        )
        b = _interleave8(o0, o1, o2, o3, o4, o5, o6, o7, BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if HAS_BIAS:
        bv = tl.load(bias_ptr + offs_n, mask=mask_n & (pid_k == 0), other=0.0).to(tl.float32)
        acc += bv[None, :]
    optrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    omask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:
        tl.atomic_add(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask, sem="relaxed")
    else:
        tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _w4a16_dequant_kernel(
    qw_ptr,
    qz_ptr,
    sc_ptr,
    w_ptr,  # out: [K, N] in the activation dtype
    N,
    N8,
    K,
    G,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_BF16: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """Dequantize a [BLOCK_K, BLOCK_N] tile (large-M path: dequantize, then cuBLAS)."""
    BN8: tl.constexpr = BLOCK_N // 8
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    offs_n8 = pid_n * BN8 + tl.arange(0, BN8)
    mask_n8 = offs_n8 < N8
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    w = tl.load(
        qw_ptr + offs_k[:, None] * N8 + offs_n8[None, :],
        mask=mask_k[:, None] & mask_n8[None, :],
        other=0,
    )
    g = k0 // G
    zw = tl.load(qz_ptr + g * N8 + offs_n8, mask=mask_n8, other=0)
    o0, o1, o2, o3, o4, o5, o6, o7 = _dequant8(
        w, zw, sc_ptr + g * (N8 * 4), offs_n8, mask_n8, IS_BF16, USE_ASM
    )
    b = _interleave8(o0, o1, o2, o3, o4, o5, o6, o7, BLOCK_K, BLOCK_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(
        w_ptr + offs_k[:, None] * N + offs_n[None, :],
        b,
        mask=mask_k[:, None] & (offs_n < N)[None, :],
    )


# ---------------------------------------------------------------------------------------------
# configs and dispatch

# (kind, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split_k)
# split_k = 0 means "choose from the shape" (fill the SMs).
_CONFIG_CACHE: dict[tuple, tuple] = {}
_ASM_OK: dict[bool, bool] = {}
_NUM_SMS: dict[int, int] = {}
GEMV_MAX_M = 4


def _m_bucket(M: int) -> int:
    return 1 << max(0, (M - 1).bit_length())


def _num_sms(device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _fit_block_k(bk: int, G: int, K: int) -> int:
    """Largest power of two <= bk that divides the group size (any bk when one group)."""
    if G >= K:
        return bk
    while bk > 16 and G % bk:
        bk //= 2
    return bk if G % bk == 0 else 0


def default_config(M: int, N: int, K: int, G: int) -> tuple:
    # measured with rotated weights on H100 and H200 (benchmarks/results, docs/kernels-w4a16.md):
    # the GEMV wins only at M = 1 and N < 16384 (gate_up 4096x24576: GEMV 75 us, tensor-core
    # kernel 49 us on H200); from M = 2 the tensor-core kernel (the M = 4 GEMV was 3.4x slower)
    if M == 1 and N < 16384:
        return ("gemv", 1, 256, 128, 4, 1, 0)
    if M <= 16:
        return ("mm", 16, 64, 128, 4, 4, 0)
    if M <= 32:
        return ("mm", 32, 128, 128, 4, 4, 0)
    if M <= 64:
        return ("mm", 64, 128, 64, 4, 4, 0)
    if M < 256:
        return ("mm", 128, 128, 64, 8, 3, 0)
    # measured on H100 (docs/kernels-w4a16.md): from M = 256 the transient dequantize + cuBLAS
    # path beats the fused tensor-core kernel (fused: ~2x fp16 cuBLAS; this: 1.0-1.3x at M >= 1024)
    return ("deq", 0, 256, 64, 4, 1, 1)


def candidate_configs(M: int) -> list[tuple]:
    """The small set tried by tune() for one M bucket (split: 0 / -m = m programs per SM)."""
    if M <= GEMV_MAX_M:
        bm = _m_bucket(M)
        return [
            ("gemv", bm, 256, 128, 4, 1, 0),
            ("gemv", bm, 128, 128, 4, 1, 0),
            ("gemv", bm, 512, 64, 8, 1, 0),
            ("gemv", bm, 256, 128, 4, 2, -4),
            ("gemv", bm, 128, 128, 4, 3, -8),
            ("gemv", bm, 128, 64, 4, 1, -8),
            ("mm", 16, 128, 128, 4, 4, 0),
            ("mm", 16, 64, 128, 4, 4, 0),
            ("mm", 16, 128, 128, 4, 4, -4),
            ("mm", 16, 64, 128, 4, 4, -8),
        ]
    if M <= 16:
        return [
            ("mm", 16, 128, 128, 4, 4, 0),
            ("mm", 16, 64, 128, 4, 4, 0),
            ("mm", 16, 256, 64, 4, 4, 0),
            ("mm", 16, 128, 64, 4, 3, 0),
            ("mm", 16, 128, 128, 4, 4, -4),
            ("mm", 16, 64, 128, 4, 4, -8),
            ("mm", 16, 128, 64, 4, 4, -8),
        ]
    if M <= 64:
        return [
            ("mm", 32 if M <= 32 else 64, 128, 128, 4, 4, 0),
            ("mm", 32 if M <= 32 else 64, 64, 128, 4, 4, 0),
            ("mm", 64, 128, 64, 4, 4, 0),
            ("mm", 64, 256, 64, 8, 3, 0),
            ("mm", 64, 128, 128, 4, 4, -4),
        ]
    if M <= 256:
        return [
            ("mm", 128, 128, 64, 8, 3, 0),
            ("mm", 64, 128, 64, 4, 4, 0),
            ("mm", 128, 256, 64, 8, 3, 0),
            ("mm", 64, 256, 64, 8, 3, 0),
            ("deq", 0, 256, 64, 4, 1, 1),
        ]
    return [
        ("mm", 128, 256, 64, 8, 3, 1),
        ("mm", 128, 128, 64, 8, 3, 1),
        ("mm", 128, 128, 64, 4, 4, 1),
        ("mm", 128, 128, 128, 8, 3, 1),
        ("deq", 0, 256, 64, 4, 1, 1),
        ("deq", 0, 128, 128, 4, 1, 1),
    ]


def _split_k(cfg: tuple, M: int, N: int, K: int, device) -> tuple[int, int]:
    """(split, k_per_split) with k_per_split a multiple of BLOCK_K."""
    kind, bm, bn, bk, _, _, split = cfg
    tiles = triton.cdiv(N, bn) * (1 if kind == "gemv" else triton.cdiv(M, bm))
    k_blocks = triton.cdiv(K, bk)
    if split <= 0:  # 0: aim at 2 programs per SM; -m: aim at m programs per SM
        target = (-split or 2) * (_num_sms(device) if not _INTERPRET else 1)
        split = max(1, min(k_blocks, triton.cdiv(target, tiles)))
    split = max(1, min(split, k_blocks))
    kps = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(K, kps)
    return split, kps


def _launch(x2, packed, bias, cfg, use_asm):
    M, K = x2.shape
    N, G = packed.out_features, packed.group_size
    kind, bm, bn, bk, warps, stages, _ = cfg
    bk = _fit_block_k(bk, G, K)
    if bk < 16:  # irregular act-order groups: unfused fallback (dequantize, then cuBLAS)
        return _fallback(x2, packed, bias)
    cfg = (kind, bm, bn, bk, warps, stages, cfg[6])
    is_bf16 = x2.dtype == torch.bfloat16
    sc = packed.scales_as(x2.dtype).view(torch.int32)
    if kind == "deq":  # dequantize into a transient [K, N] buffer, then cuBLAS
        w = torch.empty(K, N, device=x2.device, dtype=x2.dtype)
        grid = (triton.cdiv(N, bn), triton.cdiv(K, bk))
        _w4a16_dequant_kernel[grid](
            packed.qweight, packed.qzeros, sc, w, N, N // 8, K, G,
            BLOCK_N=bn, BLOCK_K=bk, IS_BF16=is_bf16, USE_ASM=use_asm,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return torch.mm(x2, w) if bias is None else torch.addmm(bias, x2, w)
    split, kps = _split_k(cfg, M, N, K, x2.device)
    atomic = split > 1
    if atomic:  # split-K partial sums meet in fp32 (fp16 atomics reached 2e-3 relative error)
        out = torch.zeros(M, N, device=x2.device, dtype=torch.float32)
    else:
        out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    common = dict(
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        ATOMIC=atomic,
        HAS_BIAS=has_bias,
        IS_BF16=is_bf16,
        USE_ASM=use_asm,
        num_warps=warps,
        num_stages=stages,
    )
    args = (x2, packed.qweight, packed.qzeros, sc, bias_arg, out, M, N, N // 8, K, G, kps)
    args += (x2.stride(0), out.stride(0))
    if kind == "gemv":
        grid = (triton.cdiv(N, bn), split)
        _w4a16_gemv_kernel[grid](*args, **common)
    else:
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), split)
        _w4a16_mm_kernel[grid](*args, GROUP_M=8, **common)
    if out.dtype != x2.dtype:
        out = out.to(x2.dtype)
    return out


def _fallback(x2, packed, bias):
    from quantfw.kernels.w4a16 import dequantize_packed

    w = dequantize_packed(packed, x2.dtype)
    out = x2 @ w
    return out if bias is None else out + bias


def _run(x2, packed, bias, cfg):
    is_bf16 = x2.dtype == torch.bfloat16
    use_asm = _ASM_OK.get(is_bf16, not _INTERPRET)
    if use_asm and is_bf16 not in _ASM_OK:
        try:
            out = _launch(x2, packed, bias, cfg, True)
            _ASM_OK[is_bf16] = True
            return out
        except Exception as e:  # inline PTX rejected by this toolchain: plain-op dequant
            import warnings

            warnings.warn(
                f"w4a16: inline-PTX dequant unavailable ({e!r:.200}); using plain ops", stacklevel=2
            )
            _ASM_OK[is_bf16] = False
            use_asm = False
    return _launch(x2, packed, bias, cfg, use_asm)


def _key(M, packed, dtype):
    return (_m_bucket(M), packed.out_features, packed.in_features, packed.group_size, dtype)


def w4a16_matmul_cuda(x2, packed, bias=None, config: tuple | None = None):
    """x2: [M, K] contiguous fp16/bf16 on CUDA (columns already permuted for act-order)."""
    if x2.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"w4a16_matmul: activations must be fp16 or bf16, got {x2.dtype}")
    M, K = x2.shape
    if config is None:
        config = _CONFIG_CACHE.get(_key(M, packed, x2.dtype))
        if config is None:
            config = default_config(M, packed.out_features, K, packed.group_size)
    if bias is not None:
        bias = bias.contiguous()
    return _run(x2, packed, bias, config)


def tune(x2, packed, bias=None, rep_ms: float = 20.0, bench=None) -> tuple:
    """Time candidate_configs for this (M bucket, shape, dtype) and cache the fastest.

    Done once per bucket at warm-up; the hot path then only does a dict lookup. `bench(cfg)`,
    when given, returns the time of one call with `cfg`: pass one that rotates weight copies
    past L2, because timing one copy (the default) favours configs that only win when the
    weight is cached (seen on H200: a config 3x slower on cold weights was picked)."""
    import triton.testing

    M = x2.shape[0]
    best, best_t = None, float("inf")
    for cfg in candidate_configs(M):
        try:
            w4a16_matmul_cuda(x2, packed, bias, config=cfg)
            if bench is None:
                t = triton.testing.do_bench(
                    lambda cfg=cfg: w4a16_matmul_cuda(x2, packed, bias, config=cfg),
                    warmup=5,
                    rep=rep_ms,
                    return_mode="median",
                )
            else:
                t = bench(cfg)
        except Exception:  # a config the compiler rejects (shared memory, registers): skip it
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is not None:
        _CONFIG_CACHE[_key(M, packed, x2.dtype)] = best
    return best
