"""Triton kernels of the fused ops: one program per token row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.common import pdl


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] with unit stride along the width (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _warps(width: int) -> int:
    return 8 if width >= 4096 else 4 if width >= 1024 else 2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    x_stride,
    res_stride,
    eps,
    HAS_RES: tl.constexpr,
    WEIGHT_IN_F32: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the add rounds, as in torch
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_IN_F32:
        y = xf * inv * w
    else:
        y = (xf * inv).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * n_cols + cols, y.to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    weight_in_float32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        res2,
        weight,
        out,
        res_out,
        n,
        x2.stride(0),
        res2.stride(0),
        eps,
        HAS_RES=residual is not None,
        WEIGHT_IN_F32=weight_in_float32,
        BLOCK=block,
        num_warps=_warps(block),
        **pdl.launch_options(pdl.enabled(x2.device)),
    )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _gate_columns(cols, group):
    """The gate's column of output column ``cols`` in groups of ``group`` gate columns, each
    followed by its ``group`` up columns (one group of d: ``[gate | up]``)."""
    return (cols // group) * (2 * group) + cols % group


@triton.jit
def _out_columns(cols, PAIRS_T: tl.constexpr):
    """Where output column ``cols`` is stored: in place, or with PAIRS_T at its position in
    `reference.transpose_pairs` (column ``32 j + 8 q + 2 p + b`` at ``32 j + 8 p + 2 q + b``)."""
    if PAIRS_T:
        i = cols % 32
        cols = cols - i + ((i // 2) % 4) * 8 + (i // 8) * 2 + i % 2
    return cols


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, d, x_stride, group, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    PAIRS_T: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gc = row * x_stride + _gate_columns(cols, group)
    g = tl.load(x_ptr + gc, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + gc + group, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * d + _out_columns(cols, PAIRS_T), (silu * u).to(dtype), mask=mask)


def silu_and_mul(
    x: torch.Tensor, interleave: int = 0, pairs_transposed: bool = False
) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(2048, triton.next_power_of_2(d))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, d, x2.stride(0), interleave or d, BLOCK=block, num_warps=_warps(block),
            PAIRS_T=pairs_transposed, **pdl.launch_options(pdl.enabled(x2.device)),
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)


@triton.jit
def _swiglu_oai_kernel(
    x_ptr,
    out_ptr,
    d,
    x_stride,
    alpha,
    limit,
    group,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
    PAIRS_T: tl.constexpr = False,
):
    pdl.wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gc = row * x_stride + _gate_columns(cols, group)
    g = tl.load(x_ptr + gc, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + gc + group, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    glu = g / (1.0 + tl.exp(-g * alpha))
    tl.store(
        out_ptr + row * d + _out_columns(cols, PAIRS_T), ((u + 1.0) * glu).to(dtype), mask=mask
    )


def swiglu_oai(
    x: torch.Tensor,
    alpha: float,
    limit: float | None,
    interleave: int = 0,
    pairs_transposed: bool = False,
) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(2048, triton.next_power_of_2(d))
    if x2.shape[0]:
        _swiglu_oai_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, d, x2.stride(0), float(alpha), float(limit or 0.0), interleave or d,
            CLAMP=limit is not None, BLOCK=block, num_warps=_warps(block),
            PAIRS_T=pairs_transposed, **pdl.launch_options(pdl.enabled(x2.device)),
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)


@triton.jit
def _norm_rope_heads(
    src,
    dst,
    w_ptr,
    c,
    s,
    eps,
    NH: tl.constexpr,
    HP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    PASS: tl.constexpr,
    PASS_P: tl.constexpr,
    HAS_NORM: tl.constexpr,
    WRITE_PASS: tl.constexpr,
):
    """Norm (optional) and rotate NH heads stored HEAD_DIM apart at `src` into `dst` (may be
    `src`). A head is [x1 (HALF) | x2 (HALF) | pass-through (PASS)]."""
    dtype = src.dtype.element_ty
    h = tl.arange(0, HP)[:, None]
    j = tl.arange(0, HALF_P)[None, :]
    m = (h < NH) & (j < HALF)
    x1 = tl.load(src + h * HEAD_DIM + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * HEAD_DIM + HALF + j, mask=m, other=0.0).to(tl.float32)
    if PASS > 0:
        p = tl.arange(0, PASS_P)[None, :]
        mp = (h < NH) & (p < PASS)
        x3 = tl.load(src + h * HEAD_DIM + 2 * HALF + p, mask=mp, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if PASS > 0:
            ss += tl.sum(x3 * x3, axis=1)
        inv = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        if PASS > 0:
            w3 = tl.load(w_ptr + 2 * HALF + p, mask=p < PASS, other=0.0).to(tl.float32)
            x3 = (x3 * inv).to(dtype).to(tl.float32) * w3
    if WRITE_PASS:
        out_ty = dst.dtype.element_ty
        tl.store(dst + h * HEAD_DIM + 2 * HALF + p, x3.to(dtype).to(out_ty), mask=mp)
    out_ty = dst.dtype.element_ty
    tl.store(dst + h * HEAD_DIM + j, (x1 * c - x2 * s).to(dtype).to(out_ty), mask=m)
    tl.store(dst + h * HEAD_DIM + HALF + j, (x2 * c + x1 * s).to(dtype).to(out_ty), mask=m)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, cs_ptr, qw_ptr, kw_ptr, k_cache, v_cache, slots,
    q_stride, k_stride, v_stride, cs_stride, eps,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, QP: tl.constexpr, KP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, PASS: tl.constexpr,
    PASS_P: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr, KVD_P: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_and_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF_P)[None, :]
    c = tl.load(cs_ptr + t * cs_stride + j, mask=j < HALF, other=0.0)
    s = tl.load(cs_ptr + t * cs_stride + HALF + j, mask=j < HALF, other=0.0)
    q_row = q_ptr + t * q_stride
    _norm_rope_heads(
        q_row, q_row, qw_ptr, c, s, eps,
        NUM_Q, QP, HEAD_DIM, HALF, HALF_P, PASS, PASS_P, HAS_NORM, HAS_NORM and PASS > 0,
    )  # fmt: skip
    k_row = k_ptr + t * k_stride
    if STORE:
        # the rotated key goes straight to its cache row; the value is copied beside it
        slot = tl.load(slots + t).to(tl.int64)
        kvd = NUM_K * HEAD_DIM
        _norm_rope_heads(
            k_row, k_cache + slot * kvd, kw_ptr, c, s, eps,
            NUM_K, KP, HEAD_DIM, HALF, HALF_P, PASS, PASS_P, HAS_NORM, PASS > 0,
        )  # fmt: skip
        offs = tl.arange(0, KVD_P)
        vm = offs < kvd
        vals = tl.load(v_ptr + t * v_stride + offs, mask=vm)
        tl.store(v_cache + slot * kvd + offs, vals.to(v_cache.dtype.element_ty), mask=vm)
    else:
        _norm_rope_heads(
            k_row, k_row, kw_ptr, c, s, eps,
            NUM_K, KP, HEAD_DIM, HALF, HALF_P, PASS, PASS_P, HAS_NORM, HAS_NORM and PASS > 0,
        )  # fmt: skip


def _token_rows(x: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """(x, row stride) for x [..., heads, head_dim] whose heads are packed head_dim apart."""
    heads, d = x.shape[-2:]
    if x.stride(-1) != 1 or x.stride(-2) != d:
        raise ValueError(f"qk_norm_rope: {name} needs unit-stride heads packed {d} apart")
    lead = x.shape[:-2]
    if len(lead) > 1:
        for i in range(len(lead) - 1):  # leading dims must flatten with one stride
            if x.stride(i) != x.stride(i + 1) * x.shape[i + 1]:
                raise ValueError(f"qk_norm_rope: {name}'s token dims do not flatten")
    stride = x.stride(-3) if x.dim() >= 3 else heads * d
    return x, stride


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, q_stride = _token_rows(q, "q")
    k, k_stride = _token_rows(k, "k")
    num_q, d = q.shape[-2:]
    num_k = k.shape[-2]
    tokens = q.numel() // (num_q * d)
    cs = cos_sin.reshape(-1, cos_sin.shape[-1]).float()
    if cs.stride(-1) != 1:
        cs = cs.contiguous()
    half = rotary_dim // 2
    passthrough = d - rotary_dim
    norm = q_weight is not None
    if store is not None:
        v, k_cache, v_cache, slots = store
        v, v_stride = _token_rows(v, "v")
    else:
        v, k_cache, v_cache, slots, v_stride = k, k, k, k, 0
    if tokens:
        _qk_norm_rope_kernel[(tokens,)](
            q, k, v, cs, q_weight if norm else q, k_weight if norm else k, k_cache, v_cache,
            slots, q_stride, k_stride, v_stride, cs.stride(0), eps,
            NUM_Q=num_q, NUM_K=num_k, QP=triton.next_power_of_2(num_q),
            KP=triton.next_power_of_2(num_k), HEAD_DIM=d, HALF=half,
            HALF_P=triton.next_power_of_2(half), PASS=passthrough,
            PASS_P=triton.next_power_of_2(max(passthrough, 1)), HAS_NORM=norm,
            STORE=store is not None, KVD_P=triton.next_power_of_2(num_k * d), num_warps=4,
            **pdl.launch_options(pdl.enabled(q.device)),
        )  # fmt: skip
    return q, k
