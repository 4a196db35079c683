"""Hopper (SM90): MoE experts through FlashInfer's CUTLASS fused MoE (``cutlass_fused_moe`` with
bf16 activations and MXFP4 weights, ``use_w4_group_scaling=True``): the routing permutation,
both grouped GEMMs with the gated activation between them, and the weighted combine, in one
call. Chosen with ``moe_backend: "flashinfer"`` (`Mxfp4Config`); measured against our own
kernels in benchmarks/mxfp4-lab-log.md.

FlashInfer's layout rules (0.7.2), applied once after loading:

* W13's rows are [up | gate] (ours are [gate | up]), and its activation is
  ``g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + beta)`` with ``g = clamp(gate,
  max=limit)``: GPT-OSS's SwiGLU is (alpha, 1, limit); SiLU-and-mul passes none of the three.
* The hidden and intermediate sizes are multiples of 128 (the kernel reads scales as int32
  words of four along K): both are padded with zero weight bytes and zero biases, so padded
  rows and columns add nothing, and the activations are padded with zero columns.
* Weights and scales are then interleaved by FlashInfer's
  ``interleave_moe_{weights,scales}_for_sm90_mixed_gemm``.

`pad_experts` is the pure part, checked on the CPU; the rest needs FlashInfer and an SM90 GPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from quantfw.kernels.fused import GatedAct
from quantfw.kernels.mxfp4.flashinfer import cuda_with
from quantfw.kernels.mxfp4.flashinfer_layout import round_up

#: hidden and intermediate sizes are padded to multiples of this
ALIGN = 128


@functools.cache
def _ops():
    from flashinfer.fused_moe import (
        cutlass_fused_moe,
        interleave_moe_scales_for_sm90_mixed_gemm,
        interleave_moe_weights_for_sm90_mixed_gemm,
    )

    return (
        cutlass_fused_moe,
        interleave_moe_weights_for_sm90_mixed_gemm,
        interleave_moe_scales_for_sm90_mixed_gemm,
    )


def available(device: torch.device) -> bool:
    """An SM90 GPU with FlashInfer's fused MoE importable."""
    return cuda_with(device, lambda cap: cap == (9, 0), _ops)


@dataclass
class PaddedExperts:
    """Experts in FlashInfer's order and sizes, before its interleave: ``w13 [E, 2 I_pad,
    H_pad / 2]`` ([up | gate] rows), ``s13 [E, 2 I_pad, H_pad / 32]``, ``w2 [E, H_pad, I_pad /
    2]``, ``s2 [E, H_pad, I_pad / 32]`` (uint8), biases ``b13 [E, 2 I_pad]``, ``b2 [E, H_pad]``."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    hidden_size: int


def pad_experts(
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
) -> PaddedExperts:
    """Our expert tensors (``w13_blocks [E, 2I, H/32, 16]`` with [gate | up] rows, scales
    ``[E, 2I, H/32]``, ``w2_blocks [E, H, I/32, 16]``, ``w2_scales [E, H, I/32]``, biases
    ``[E, 2I]`` and ``[E, H]``) -> `PaddedExperts`."""
    e, two_i, h_groups, _ = w13_blocks.shape
    i, h = two_i // 2, h_groups * 32
    i_pad, h_pad = round_up(i, ALIGN), round_up(h, ALIGN)

    def up_gate(t: torch.Tensor, width: int, width_pad: int) -> torch.Tensor:
        out = t.new_zeros(e, 2 * i_pad, width_pad)
        flat = t.reshape(e, two_i, width)
        out[:, :i, :width] = flat[:, i:]
        out[:, i_pad : i_pad + i, :width] = flat[:, :i]
        return out

    def padded(t: torch.Tensor, rows_pad: int, width: int, width_pad: int) -> torch.Tensor:
        out = t.new_zeros(e, rows_pad, width_pad)
        out[:, : t.shape[1], :width] = t.reshape(e, t.shape[1], width)
        return out

    b13 = None
    if w13_bias is not None:
        b13 = up_gate(w13_bias.unsqueeze(-1), 1, 1).squeeze(-1)
    b2 = None
    if w2_bias is not None:
        b2 = padded(w2_bias.unsqueeze(-1), h_pad, 1, 1).squeeze(-1)
    elif w13_bias is not None:
        # FlashInfer takes both biases or neither: a TP rank other than 0 adds no W2 bias (the
        # all-reduce would count it twice) and passes zeros
        b2 = w13_bias.new_zeros(e, h_pad)
    return PaddedExperts(
        w13=up_gate(w13_blocks, h // 2, h_pad // 2),
        s13=up_gate(w13_scales, h_groups, h_pad // 32),
        w2=padded(w2_blocks, h_pad, i // 2, i_pad // 2),
        s2=padded(w2_scales, h_pad, i // 32, i_pad // 32),
        b13=b13,
        b2=b2,
        hidden_size=h,
    )


def activation_args(
    spec: GatedAct, num_experts: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(swiglu_alpha, swiglu_beta, swiglu_limit), float32 per expert, for `spec`."""
    if spec.kind == "silu":
        return None, None, None
    if spec.kind == "swiglu_oai":

        def full(v: float) -> torch.Tensor:
            return torch.full((num_experts,), v, dtype=torch.float32, device=device)

        return full(spec.alpha), full(1.0), full(spec.clamp)
    raise ValueError(
        f"FlashInfer's SM90 fused MoE: activation {spec.kind!r}; supported: 'silu', 'swiglu_oai'"
    )


@dataclass
class Sm90Experts:
    """What `moe_forward` passes to FlashInfer: interleaved weights, int32-viewed scales,
    padded biases and the activation's per-expert arguments."""

    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor
    s2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    alpha: torch.Tensor | None
    beta: torch.Tensor | None
    limit: torch.Tensor | None
    hidden_size: int

    @classmethod
    def tensor_names(cls) -> list[str]:
        """The fields that hold tensors (all but ``hidden_size``)."""
        return [f.name for f in fields(cls) if f.name != "hidden_size"]

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors, by field name (for a layer to keep as buffers)."""
        return {name: getattr(self, name) for name in self.tensor_names()}

    @classmethod
    def from_layer(cls, layer: torch.nn.Module, prefix: str) -> Sm90Experts:
        """The experts a layer keeps as buffers ``<prefix><field>`` (see `tensors`)."""
        tensors = {name: getattr(layer, prefix + name) for name in cls.tensor_names()}
        return cls(**tensors, hidden_size=getattr(layer, prefix + "hidden_size"))

    @classmethod
    def prepare(cls, padded: PaddedExperts, spec: GatedAct) -> Sm90Experts:
        _, interleave_weights, interleave_scales = _ops()
        alpha, beta, limit = activation_args(spec, padded.w13.shape[0], padded.w13.device)
        return cls(
            w13=interleave_weights(padded.w13, "fp4"),
            w2=interleave_weights(padded.w2, "fp4"),
            s13=interleave_scales(padded.s13).view(torch.int32),
            s2=interleave_scales(padded.s2).view(torch.int32),
            b13=padded.b13,
            b2=padded.b2,
            alpha=alpha,
            beta=beta,
            limit=limit,
            hidden_size=padded.hidden_size,
        )


#: token counts the tactics are picked at; a call uses those of the largest one <= its tokens,
#: and FlashInfer's defaults below 128 tokens, where an eager call's host time exceeds its GPU
#: time and timing it picks worse tactics than the defaults (mxfp4-lab-log §28)
TUNE_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192)

# picked tactics by (device, experts, 2 I_pad, H_pad, top_k, activation): layers of one shape
# pick once
_TACTICS: dict[tuple, dict[int, tuple[int, int]]] = {}


def _runner() -> Any:
    """FlashInfer's bf16 x MXFP4 runner object (made by the first `moe_forward`)."""
    from flashinfer.fused_moe.core import get_cutlass_fused_moe_module

    runners = get_cutlass_fused_moe_module("90").MoERunner.runner_dict
    for key, runner in runners.items():
        if key[0] == torch.bfloat16 and key[4]:  # activation dtype, use_w4_group_scaling
            return runner
    raise RuntimeError("FlashInfer's bf16 x MXFP4 MoE runner was not created")


def _fastest(
    call: Callable[[list[int]], object], candidates: list[int], fixed: tuple[int, int], slot: int
) -> int:
    """The fastest of -1 (FlashInfer's default) and `candidates` in ``profile_ids[slot]``, the
    other slot held at `fixed`."""
    from quantfw.kernels.common.timing import events_median

    best, best_us = -1, math.inf
    for tactic in [-1, *candidates]:
        pair = list(fixed)
        pair[slot] = tactic
        try:
            us = events_median(lambda p=pair: call(p), iters=5)
        except Exception:  # a tactic FlashInfer lists but cannot launch for this shape
            continue
        if us < best_us:
            best, best_us = tactic, us
    return best


def pick_tactics(experts: Sm90Experts, top_k: int) -> dict[int, tuple[int, int]]:
    """Each GEMM's fastest CUTLASS tactic at each of `TUNE_TOKENS`, timed on random inputs
    (GEMM1's with GEMM2's default, then GEMM2's with GEMM1's pick), once per shape.

    FlashInfer's own autotuner (``autotune()``) ran here but its picks did not reach later
    calls (likely: its in-memory winners are keyed by the runner instance, which
    `cutlass_fused_moe` makes anew on every call), and its untuned default ran a 4096-token
    GPT-OSS-20B layer 4x slower than quantfw's kernels (mxfp4-lab-log §28). The picks go to
    FlashInfer as ``profile_ids``."""
    e, two_i, h_pad = experts.w13.shape[0], experts.w13.shape[1], experts.w2.shape[1]
    dev = experts.w13.device
    key = (dev, e, two_i, h_pad, top_k, experts.alpha is None)
    if key in _TACTICS:
        return _TACTICS[key]
    g = torch.Generator(device=dev).manual_seed(0)
    picks: dict[int, tuple[int, int]] = {}
    first = second = None
    for t in TUNE_TOKENS:
        x = torch.randn(t, experts.hidden_size, generator=g, device=dev).bfloat16()
        ids = torch.rand(t, e, generator=g, device=dev).argsort(-1)[:, :top_k]
        weights = torch.full((t, top_k), 1.0 / top_k, device=dev)
        if first is None:  # the first call creates the runner; its tactics depend on the shape
            moe_forward(x, weights, ids, experts)
            runner = _runner()
            first = list(runner.get_valid_tactics_for_shape(1, two_i, h_pad))
            second = list(runner.get_valid_tactics_for_shape(2, h_pad, two_i // 2))

        def call(pair: list[int], x=x, weights=weights, ids=ids) -> torch.Tensor:
            return moe_forward(x, weights, ids, experts, pair)

        t1 = _fastest(call, first, (-1, -1), 0)
        picks[t] = (t1, _fastest(call, second, (t1, -1), 1))
    _TACTICS[key] = picks
    return picks


def tactics_for(picks: dict[int, tuple[int, int]] | None, tokens: int) -> list[int] | None:
    """The picked ``profile_ids`` for a call of `tokens` tokens (None: FlashInfer's defaults,
    also below the smallest picked count)."""
    bucket = max((t for t in picks or {} if t <= tokens), default=None)
    return None if bucket is None else list(picks[bucket])


def moe_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: Sm90Experts,
    profile_ids: list[int] | None = None,
) -> torch.Tensor:
    """x [T, H] (bf16) routed to ``topk_ids [T, k]`` with ``topk_weights [T, k]`` -> [T, H],
    with FlashInfer's GEMM tactics `profile_ids` (``[gemm1, gemm2]``, -1 its default)."""
    cutlass_fused_moe = _ops()[0]
    h_pad = experts.w2.shape[1]
    x_in = x if x.shape[1] == h_pad else F.pad(x, (0, h_pad - x.shape[1]))
    out = x.new_empty(x.shape[0], h_pad)
    cutlass_fused_moe(
        x_in.contiguous(),
        topk_ids.to(torch.int32),
        topk_weights.to(torch.float32),
        experts.w13,
        experts.w2,
        x.dtype,
        quant_scales=[experts.s13, experts.s2],
        fc1_expert_biases=experts.b13,
        fc2_expert_biases=experts.b2,
        swiglu_alpha=experts.alpha,
        swiglu_beta=experts.beta,
        swiglu_limit=experts.limit,
        use_w4_group_scaling=True,
        profile_ids=profile_ids,
        output=out,
    )
    if h_pad == experts.hidden_size:
        return out
    return out[:, : experts.hidden_size].contiguous()  # the all-reduce under TP needs it whole
