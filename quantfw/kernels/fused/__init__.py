"""Fused small ops of a decoder layer: RMSNorm (with the residual add), per-head q/k RMSNorm +
rotary (optionally storing the rotated key and the value in the paged KV cache), SiLU-and-mul,
GPT-OSS's clamped SwiGLU, and the KV-cache store alone.

Each op has a plain torch path (`reference.py`, the CPU path and what tests compare against,
matching transformers' arithmetic and rounding) and one Triton kernel (`triton_ops.py`) used for
CUDA tensors when Triton is installed. The Triton kernels compute in float32 and round where
transformers rounds, except rotary, which rounds once instead of after every product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantfw.kernels.common import triton_available
from quantfw.kernels.fused import reference
from quantfw.kernels.fused.reference import (
    deinterleave_gate_up,
    interleave_gate_up,
    transpose_pairs,
)

__all__ = [
    "GatedAct",
    "interleave_gate_up",
    "deinterleave_gate_up",
    "transpose_pairs",
    "rms_norm",
    "silu_and_mul",
    "swiglu_oai",
    "qk_norm_rope",
    "store_kv",
    "triton_available",
]


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    weight_in_float32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim (float32 statistics). With `residual`: ``h = x + residual``
    (rounded to x's dtype) is normalized and ``(norm(h), h)`` returned; without, ``norm(x)``.
    The normalized x is rounded to x's dtype and then scaled by `weight` (Llama), or with
    `weight_in_float32` scaled in float32 and rounded once (GPT-OSS, T5)."""
    if _use_triton(x):
        from quantfw.kernels.fused import triton_ops

        return triton_ops.rms_norm(x, weight, eps, residual, weight_in_float32=weight_in_float32)
    return reference.rms_norm(x, weight, eps, residual, weight_in_float32=weight_in_float32)


def _check_interleave(x: torch.Tensor, interleave: int, op: str) -> None:
    if interleave < 0 or (interleave and x.shape[-1] % (2 * interleave)):
        raise ValueError(
            f"{op}: interleave={interleave} must be 0 or a positive divisor of half the width "
            f"{x.shape[-1]} (groups of interleave gate columns then their up columns)"
        )


def _check_pairs_transposed(x: torch.Tensor, pairs_transposed: bool, op: str) -> None:
    if pairs_transposed and x.shape[-1] % 64:
        raise ValueError(
            f"{op}: pairs_transposed needs an output width that is a multiple of 32, got "
            f"{x.shape[-1] // 2}"
        )


def silu_and_mul(
    x: torch.Tensor, interleave: int = 0, pairs_transposed: bool = False
) -> torch.Tensor:
    """``silu(gate) * up`` for x of width 2d: ``[gate (d) | up (d)]``, or with `interleave` g
    groups of g gate columns, each followed by its g up columns. `pairs_transposed`: the output
    in `reference.transpose_pairs`' order (what the MXFP4 wgmma kernel reads)."""
    _check_interleave(x, interleave, "silu_and_mul")
    _check_pairs_transposed(x, pairs_transposed, "silu_and_mul")
    if _use_triton(x):
        from quantfw.kernels.fused import triton_ops

        return triton_ops.silu_and_mul(x, interleave, pairs_transposed)
    out = reference.silu_and_mul(x, interleave)
    return reference.transpose_pairs(out) if pairs_transposed else out


def swiglu_oai(
    x: torch.Tensor,
    alpha: float,
    limit: float | None,
    interleave: int = 0,
    pairs_transposed: bool = False,
) -> torch.Tensor:
    """GPT-OSS's SwiGLU on x = [gate (d) | up (d)] (or interleaved, see `silu_and_mul`):
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate,
    max=limit)`` (no clamp when limit is None); `pairs_transposed` as in `silu_and_mul`."""
    _check_interleave(x, interleave, "swiglu_oai")
    _check_pairs_transposed(x, pairs_transposed, "swiglu_oai")
    if _use_triton(x):
        from quantfw.kernels.fused import triton_ops

        return triton_ops.swiglu_oai(x, alpha, limit, interleave, pairs_transposed)
    out = reference.swiglu_oai(x, alpha, limit, interleave)
    return reference.transpose_pairs(out) if pairs_transposed else out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm (Qwen3's q_norm/k_norm) then rotate-half rotary embedding of the
    first `rotary_dim` features of q [..., heads, head_dim] and k [..., kv_heads, head_dim].

    `cos_sin` [..., rotary_dim] (float32) holds cos of the rotary_dim/2 frequencies then their sin
    (`RotaryEmbedding.cos_sin`). May work in place on q and k (views of a fused qkv output are
    fine); returns the rotated q and k. With ``store=(v, k_cache, v_cache, slots)`` the rotated
    keys and the values are also written at the flat cache rows `slots` (see `store_kv`); the
    Triton path then writes the keys only there (the returned k is not rotated)."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: pass both q_weight and k_weight, or neither")
    if _use_triton(q):
        from quantfw.kernels.fused import triton_ops

        return triton_ops.qk_norm_rope(q, k, cos_sin, rotary_dim, q_weight, k_weight, eps, store)
    return reference.qk_norm_rope(q, k, cos_sin, rotary_dim, q_weight, k_weight, eps, store)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write k/v [T, kv_heads, head_dim] at flat rows `slots` [T] of the paged cache
    ``[num_blocks, block_size, kv_heads, head_dim]`` (row = block * block_size + offset)."""
    if _use_triton(k):
        from quantfw.kernels.attention import triton_paged

        triton_paged.store_kv(k, v, k_cache, v_cache, slots)
        return
    reference.store_kv(k, v, k_cache, v_cache, slots)


@dataclass(frozen=True)
class GatedAct:
    """A gated activation as GEMM kernels may fuse it: ``kind`` "silu" (`silu_and_mul`) or
    "swiglu_oai" (`swiglu_oai` with ``alpha`` and ``limit``)."""

    kind: str
    alpha: float = 1.0
    limit: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "swiglu_oai"):
            raise ValueError(f"GatedAct: kind {self.kind!r}; supported: 'silu', 'swiglu_oai'")

    def __call__(
        self, x: torch.Tensor, interleave: int = 0, pairs_transposed: bool = False
    ) -> torch.Tensor:
        if self.kind == "silu":
            return silu_and_mul(x, interleave, pairs_transposed)
        return swiglu_oai(x, self.alpha, self.limit, interleave, pairs_transposed)

    @property
    def clamp(self) -> float:
        """The limit as a kernel takes it (infinite: no clamp)."""
        return math.inf if self.limit is None else float(self.limit)
