"""Rotary position embedding with the scaling variants HF configs describe.

Supported ``rope_type``: default, linear, dynamic (NTK-aware, recomputed when positions exceed
the trained context), llama3 and yarn. Formulas follow transformers' ``modeling_rope_utils``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quantfw.kernels import fused
from quantfw.layers.norm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """One flat dict with rope_type, rope_theta and the scaling keys, from either the
    ``rope_parameters`` (transformers 5) or the ``rope_theta`` + ``rope_scaling`` form."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if isinstance(scaling, dict):
        for key, value in scaling.items():
            params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            getattr(hf_config, "original_max_position_embeddings", None)
            or hf_config.max_position_embeddings,
        )
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, dim: int, p: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


@dataclass
class RopeArgs:
    """What attention needs to rotate (and per-head normalize) q and k itself, so a backend can
    fuse the rotation with storing the keys in the cache (`quantfw.kernels.fused.qk_norm_rope`)."""

    cos_sin: torch.Tensor
    rotary_dim: int
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, store: tuple | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused.qk_norm_rope(
            q, k, self.cos_sin, self.rotary_dim, self.q_weight, self.k_weight, self.eps, store
        )


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX style) rotary embedding of the first `rotary_dim` features of q and
    k. `cos_sin(positions)` gives each position's cos and sin (float32) from a table grown on
    demand (recomputed per call for the dynamic type, whose frequencies depend on the length);
    `args` packs them for `Attention(..., rope=...)`, which rotates q and k (and optionally
    RMS-normalizes them per head) through the fused kernels."""

    def __init__(self, head_dim: int, max_position_embeddings: int, params: dict[str, Any]):
        super().__init__()
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self.rope_type = rope_type
        self.params = params
        self.base = float(params["rope_theta"])
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.max_position_embeddings = max_position_embeddings
        self.attention_scaling = 1.0
        inv_freq = _base_inv_freq(self.base, self.rotary_dim)
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(
                self.base, self.rotary_dim, params, max_position_embeddings
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_sin_cache", torch.empty(0, self.rotary_dim), persistent=False)

    def _inv_freq_for(self, positions: torch.Tensor) -> torch.Tensor:
        seq_len = int(positions.max().item()) + 1
        if seq_len <= self.max_position_embeddings:
            return self.inv_freq
        factor, dim = self.params["factor"], self.rotary_dim
        base = self.base * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        return _base_inv_freq(base, dim).to(self.inv_freq.device)

    def _table(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        freqs = positions.float().unsqueeze(-1) * inv_freq.float()
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling

    def reserve(self, num_positions: int) -> None:
        """Make the cos/sin table hold positions ``< num_positions`` (no-op for dynamic)."""
        if self.rope_type == "dynamic" or self.cos_sin_cache.shape[0] >= num_positions:
            return
        device = self.inv_freq.device
        positions = torch.arange(num_positions, device=device)
        self.cos_sin_cache = self._table(positions, self.inv_freq)

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """[*positions.shape, rotary_dim] float32: cos of the rotary_dim/2 frequencies, then sin.
        Positions beyond the table need a `reserve` first (the engine reserves max_model_len)."""
        if self.rope_type == "dynamic":
            return self._table(positions, self._inv_freq_for(positions))
        return self.cos_sin_cache[positions.long()]

    def args(
        self, cos_sin: torch.Tensor, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
    ) -> RopeArgs:
        """The rotation of `cos_sin`'s positions (after per-head RMSNorm when `q_norm`/`k_norm`
        are given), for `Attention(..., rope=...)`."""
        return RopeArgs(
            cos_sin,
            self.rotary_dim,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0,
        )


def get_rope(head_dim: int, hf_config: Any) -> RotaryEmbedding:
    """The rotary embedding an HF config describes."""
    return RotaryEmbedding(head_dim, hf_config.max_position_embeddings, rope_parameters(hf_config))
