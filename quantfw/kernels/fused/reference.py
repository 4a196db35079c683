"""The torch paths of the fused ops, with transformers' arithmetic (see the package docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    weight_in_float32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float32:
        out = (weight.float() * normed).to(x.dtype)
    else:
        out = weight * normed.to(x.dtype)
    return out if residual is None else (out, x)


def _swap_outer(t: torch.Tensor, dim: int, a: int, b: int, group: int) -> torch.Tensor:
    """`t` with `dim` read as [a, b, group] rewritten as [b, a, group]."""
    dim = dim % t.ndim
    return t.unflatten(dim, (a, b, group)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def interleave_gate_up(t: torch.Tensor, group: int, dim: int = 0) -> torch.Tensor:
    """A gated pair's ``[gate (d) | up (d)]`` along `dim` (weight rows, bias, or output columns)
    -> d / group groups of `group` gate entries, each followed by its `group` up entries."""
    return _swap_outer(t, dim, 2, t.shape[dim] // (2 * group), group)


def deinterleave_gate_up(t: torch.Tensor, group: int, dim: int = -1) -> torch.Tensor:
    """The inverse of `interleave_gate_up`."""
    return _swap_outer(t, dim, t.shape[dim] // (2 * group), 2, group)


def gate_and_up(x: torch.Tensor, interleave: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a gated pair's output x: ``[gate (d) | up (d)]``, or with `interleave` g
    groups of ``[g gate columns | their g up columns]``."""
    if interleave:
        pairs = x.unflatten(-1, (-1, 2, interleave))
        return pairs[..., 0, :].flatten(-2), pairs[..., 1, :].flatten(-2)
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def transpose_pairs(y: torch.Tensor) -> torch.Tensor:
    """y [..., d] (d a multiple of 32) with each block of 32 columns' 16 pairs transposed as a
    4 x 4 matrix: position ``32 j + 8 p + 2 q + b`` holds column ``32 j + 8 q + 2 p + b``
    (the k order of the MXFP4 wgmma kernel's activations, `mxfp4.triton.wgmma`)."""
    *lead, d = y.shape
    return y.reshape(*lead, d // 32, 4, 4, 2).transpose(-3, -2).reshape(*lead, d)


def silu_and_mul(x: torch.Tensor, interleave: int = 0) -> torch.Tensor:
    gate, up = gate_and_up(x, interleave)
    return F.silu(gate) * up


def swiglu_oai(
    x: torch.Tensor, alpha: float, limit: float | None, interleave: int = 0
) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU on x = [gate (d) | up (d)]: gate clamped above and up on both
    sides at `limit`, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate_and_up(x, interleave)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    kv_h, d = k_cache.shape[-2:]
    k_cache.view(-1, kv_h, d).index_copy_(0, slots, k.reshape(-1, kv_h, d).to(k_cache.dtype))
    v_cache.view(-1, kv_h, d).index_copy_(0, slots, v.reshape(-1, kv_h, d).to(v_cache.dtype))


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
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    half = rotary_dim // 2
    cos = torch.cat((cos_sin[..., :half], cos_sin[..., :half]), dim=-1).unsqueeze(-2)
    sin = torch.cat((cos_sin[..., half:], cos_sin[..., half:]), dim=-1).unsqueeze(-2)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q, k = _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)
    if store is not None:
        v, k_cache, v_cache, slots = store
        store_kv(k, v, k_cache, v_cache, slots)
    return q, k
