"""Round-to-nearest (RTN) export into the AWQ (AutoAWQ GEMM) or GPTQ (GPTQModel) on-disk
format. No calibration: each group's scale and zero come from its min/max.

Only the decoder's linear layers (q/k/v/o/gate/up/down_proj) are quantized; embeddings, norms
and lm_head keep their dtype. See docs/formats.md for the layouts.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from quantfw.exporter.checkpoint import quantize_linears
from quantfw.kernels import reference

#: layers whose inputs are the same tensor share an act-order permutation (and so g_idx)
_SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def _group_ids(in_features: int, group_size: int, perm: torch.Tensor | None) -> torch.Tensor:
    """g_idx [in]: the group of each input row; under act-order the i-th row of `perm` is the
    i-th row quantized, so g_idx[perm[i]] = i // group_size."""
    ordered = reference.group_index(in_features, group_size)
    if perm is None:
        return ordered
    g_idx = torch.empty_like(ordered)
    g_idx[perm] = ordered
    return g_idx


def rtn_quantize(
    weight: torch.Tensor,
    *,
    bits: int,
    g_idx: torch.Tensor,
    style: str,
    sym: bool = False,
    min_zero: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize `weight [out, in]` per group of input rows given by `g_idx`.

    Returns (codes [in, out] int32, zeros [G, out] int32, scales [G, out] fp16) with
    ``W ~= (codes - zeros[g_idx]) * scales[g_idx]``. `style` "awq" follows AutoAWQ's
    pseudo_quantize (asymmetric on [min, max]); "gptq" follows GPTQ's Quantizer (range widened
    to include 0; `sym` centres the zero at 2**(bits-1)). Zeros are clamped to >= `min_zero`.
    """
    maxq = 2**bits - 1
    w = weight.detach().t().float()  # [in, out]
    num_groups = int(g_idx.max()) + 1
    index = g_idx.long().unsqueeze(1).expand_as(w)
    shape = (num_groups, w.shape[1])
    gmin = torch.full(shape, math.inf).scatter_reduce(0, index, w, "amin")
    gmax = torch.full(shape, -math.inf).scatter_reduce(0, index, w, "amax")
    if style == "awq":
        scales = (gmax - gmin).clamp(min=1e-5) / maxq
        zeros = (-torch.round(gmin / scales)).clamp(0, maxq)
    else:
        xmin, xmax = gmin.clamp(max=0), gmax.clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        empty = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(empty, -1.0, xmin), torch.where(empty, 1.0, xmax)
        scales = (xmax - xmin) / maxq
        zeros = torch.full_like(scales, (maxq + 1) // 2) if sym else torch.round(-xmin / scales)
    scales = scales.to(torch.float16).float().clamp(min=torch.finfo(torch.float16).tiny)
    zeros = zeros.clamp(min_zero, maxq)
    g = g_idx.long()
    codes = torch.clamp(torch.round(w / scales[g]) + zeros[g], 0, maxq)
    return codes.to(torch.int32), zeros.to(torch.int32), scales.to(torch.float16)


class Int4Exporter:
    def __init__(
        self,
        *,
        method: str,
        bits: int,
        group_size: int,
        desc_act: bool,
        sym: bool,
        checkpoint_format: str,
        seed: int,
    ):
        self.method, self.bits, self.group_size = method, bits, group_size
        self.desc_act, self.sym, self.checkpoint_format, self.seed = (
            desc_act,
            sym,
            checkpoint_format,
            seed,
        )

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {
                "quant_method": "awq",
                "bits": self.bits,
                "group_size": self.group_size,
                "zero_point": True,
                "version": "gemm",
                "modules_to_not_convert": None,
            }
        from quantfw import __version__

        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "sym": self.sym,
            "lm_head": False,
            "static_groups": False,
            "true_sequential": True,
            "damp_percent": 0.01,
            "checkpoint_format": self.checkpoint_format,
            "pack_dtype": "int32",
            "meta": {"quantizer": [f"quantfw:{__version__}"], "method": "rtn"},
        }

    def _permutation(self, prefix: str, in_features: int) -> torch.Tensor | None:
        if not self.desc_act:
            return None
        head, _, leaf = prefix.rpartition(".")
        key = f"{self.seed}:{head}.{_SHARED_INPUT.get(leaf, leaf)}"
        generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        return torch.randperm(in_features, generator=generator)

    def _check(self, name: str, out_features: int, in_features: int) -> None:
        per_word = 8 if self.method == "awq" else 32 // math.gcd(32, self.bits)
        packed_out = out_features % per_word
        packed_in = self.method == "gptq" and in_features % per_word
        grouped = self.group_size != -1 and in_features % self.group_size and self.method == "awq"
        if packed_out or packed_in or grouped:
            raise ValueError(
                f"cannot export {name!r} of shape [{out_features}, {in_features}] as "
                f"{self.method} bits={self.bits} group_size={self.group_size}: output features "
                f"must be a multiple of {per_word}"
                + (f", input features a multiple of {per_word}" if self.method == "gptq" else "")
                + (f" and input features a multiple of {self.group_size}" if grouped else "")
            )

    def quantize_linear(
        self, prefix: str, weight: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        out_features, in_features = weight.shape
        self._check(f"{prefix}.weight", out_features, in_features)
        if self.method == "awq":
            g_idx = reference.group_index(in_features, self.group_size)
            codes, zeros, scales = rtn_quantize(weight, bits=4, g_idx=g_idx, style="awq")
            yield f"{prefix}.qweight", reference.pack_awq(codes)
            yield f"{prefix}.qzeros", reference.pack_awq(zeros)
            yield f"{prefix}.scales", scales
            return
        g_idx = _group_ids(in_features, self.group_size, self._permutation(prefix, in_features))
        v1 = self.checkpoint_format == "gptq"
        # v1 stores z - 1, so z = 0 is not representable: keep zeros >= 1
        codes, zeros, scales = rtn_quantize(
            weight, bits=self.bits, g_idx=g_idx, style="gptq", sym=self.sym, min_zero=int(v1)
        )
        stored = (zeros - 1) if v1 else zeros
        yield f"{prefix}.qweight", reference.pack_int32(codes, self.bits, dim=0)
        yield f"{prefix}.qzeros", reference.pack_int32(stored, self.bits, dim=1)
        yield f"{prefix}.scales", scales
        yield f"{prefix}.g_idx", g_idx.to(torch.int32)

    def convert(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return quantize_linears(tensors, self.quantize_linear)


#: the options each method takes, with their defaults
_OPTIONS: dict[str, dict[str, Any]] = {
    "awq": {"bits": 4, "group_size": 128, "zero_point": True},
    "gptq": {
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
        "seed": 0,
    },
}


def build(method: str, args: dict[str, Any], hf_config: dict[str, Any]) -> Int4Exporter:
    """The AWQ or GPTQ exporter for `args` (validated; unknown options are an error)."""
    unknown = sorted(set(args) - set(_OPTIONS[method]))
    if unknown:
        raise ValueError(
            f"{method} export: unknown option(s) {unknown}; supported: {sorted(_OPTIONS[method])}"
        )
    o = {**_OPTIONS[method], **args}
    if o["group_size"] != -1 and o["group_size"] <= 0:
        raise ValueError(f"group_size={o['group_size']} is invalid; use a positive size or -1")
    if method == "awq":
        if o["bits"] != 4 or not o["zero_point"]:
            raise ValueError(
                "AWQ GEMM export supports bits=4 and zero_point=True; got "
                f"bits={o['bits']}, zero_point={o['zero_point']}"
            )
        o.update(desc_act=False, sym=False, checkpoint_format="gptq", seed=0)
        del o["zero_point"]
    else:
        if o["bits"] not in reference.SUPPORTED_GPTQ_BITS:
            raise ValueError(
                f"GPTQ export: bits={o['bits']} not supported; supported: "
                f"{list(reference.SUPPORTED_GPTQ_BITS)}"
            )
        if o["checkpoint_format"] not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"GPTQ export: checkpoint_format={o['checkpoint_format']!r} not supported; "
                "supported: ['gptq', 'gptq_v2']"
            )
    return Int4Exporter(method=method, **o)
