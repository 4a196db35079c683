"""FlashInfer's SM90 fused MoE as an MXFP4 expert backend (`kernels.mxfp4.flashinfer_sm90`):
its layout (the [up | gate] order and the padding to 128) on the CPU, the call on an SM90 GPU
with FlashInfer installed against the dequantize-per-expert reference."""

from __future__ import annotations

import math

import pytest
import tiny_moe
import torch

from quantfw.kernels import moe, mxfp4
from quantfw.kernels.fused import GatedAct
from quantfw.kernels.fused import reference as fused_ref
from quantfw.kernels.mxfp4 import flashinfer_sm90 as fs


def _random_experts(e, h, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.05
    w2 = torch.randn(e, h, i, generator=g) * 0.05
    b13 = torch.randn(e, 2 * i, generator=g)
    b2 = torch.randn(e, h, generator=g)
    return mxfp4.quantize(w13), mxfp4.quantize(w2), b13, b2


@pytest.mark.parametrize("h,i", [(160, 96), (256, 128), (96, 288)])
def test_pad_experts_puts_up_before_gate_and_pads_with_zeros(h, i):
    e = 3
    (b13, s13), (b2, s2), bias13, bias2 = _random_experts(e, h, i)
    p = fs.pad_experts(b13, s13, b2, s2, bias13, bias2)
    h_pad, i_pad = math.ceil(h / 128) * 128, math.ceil(i / 128) * 128
    assert p.w13.shape == (e, 2 * i_pad, h_pad // 2) and p.s13.shape == (e, 2 * i_pad, h_pad // 32)
    assert p.w2.shape == (e, h_pad, i_pad // 2) and p.s2.shape == (e, h_pad, i_pad // 32)
    assert p.hidden_size == h

    def deq(w, s):
        return mxfp4.dequantize(w.unflatten(-1, (-1, 16)), s, torch.float32)

    ours13, got13 = deq(b13.flatten(-2), s13), deq(p.w13, p.s13)
    gate, up = ours13[:, :i], ours13[:, i:]
    assert torch.equal(got13[:, :i, :h], up)
    assert torch.equal(got13[:, i_pad : i_pad + i, :h], gate)
    keep = torch.zeros_like(got13, dtype=torch.bool)
    keep[:, :i, :h] = keep[:, i_pad : i_pad + i, :h] = True
    assert not got13[~keep].any(), "padding must decode to zero"
    got2 = deq(p.w2, p.s2)
    assert torch.equal(got2[:, :h, :i], deq(b2.flatten(-2), s2))
    assert not got2[:, h:].any() and not got2[:, :, i:].any()
    assert torch.equal(p.b13[:, :i], bias13[:, i:]) and torch.equal(
        p.b13[:, i_pad:][:, :i], bias13[:, :i]
    )
    assert not p.b13[:, i:i_pad].any() and not p.b13[:, i_pad + i :].any()
    assert torch.equal(p.b2[:, :h], bias2) and not p.b2[:, h:].any()


def test_pad_experts_without_biases():
    (b13, s13), (b2, s2), bias13, _ = _random_experts(2, 128, 128)
    p = fs.pad_experts(b13, s13, b2, s2, None, None)
    assert p.b13 is None and p.b2 is None
    # a TP rank other than 0 has W13's bias but adds no W2 bias: FlashInfer gets zeros
    p = fs.pad_experts(b13, s13, b2, s2, bias13, None)
    assert p.b2.shape == (2, 128) and p.b2.dtype == bias13.dtype and not p.b2.any()


def test_activation_args():
    assert fs.activation_args(GatedAct("silu"), 4, torch.device("cpu")) == (None, None, None)
    alpha, beta, limit = fs.activation_args(
        GatedAct("swiglu_oai", 1.702, None), 4, torch.device("cpu")
    )
    assert alpha.dtype == torch.float32 and alpha.shape == (4,)
    assert torch.all(alpha == 1.702) and torch.all(beta == 1.0) and torch.all(limit == math.inf)


def test_not_available_off_sm90():
    assert not fs.available(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("h,i", [(2880, 2880), (2880, 1440), (2880, 736), (256, 96)])
@pytest.mark.parametrize("act", ["swiglu_oai", "silu"])
def test_gpu_matches_reference(h, i, act):
    """GPT-OSS-20B's experts at TP 1, 2 and 4 (I per rank 2880, 1440, 736: none a multiple of
    128), and a small case padded in both sizes; bf16 against the float32 reference."""
    tiny_moe.require_sm90_flashinfer()
    e, top = 32 if h == 2880 else 8, 4
    spec = GatedAct("swiglu_oai", 1.702, 7.0) if act == "swiglu_oai" else GatedAct("silu")
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, generator=g, device="cuda") * 0.05
    w2 = torch.randn(e, h, i, generator=g, device="cuda") * 0.05
    q13, q2 = mxfp4.quantize(w13), mxfp4.quantize(w2)
    d13, d2 = mxfp4.dequantize(*q13, torch.float32), mxfp4.dequantize(*q2, torch.float32)
    del w13, w2
    b13 = (torch.randn(e, 2 * i, generator=g, device="cuda") * 0.1).bfloat16()
    b2 = (torch.randn(e, h, generator=g, device="cuda") * 0.1).bfloat16()
    experts = fs.Sm90Experts.prepare(fs.pad_experts(*q13, *q2, b13, b2), spec)
    for tokens in (1, 3, 16, 77, 512):
        x = torch.randn(tokens, h, generator=g, device="cuda").bfloat16()
        logits = torch.randn(tokens, e, generator=g, device="cuda").bfloat16()
        weights, ids = moe.select_experts(logits, top, "topk_softmax")
        act_fn = (
            (lambda y: fused_ref.swiglu_oai(y, 1.702, 7.0))
            if act == "swiglu_oai"
            else fused_ref.silu_and_mul
        )
        ref = moe.experts_forward_cpu(
            x.float(), weights.float(), ids, num_experts=e,
            expert_weights=lambda ex: (d13[ex], d2[ex]),
            activation=act_fn, w13_bias=b13.float(), w2_bias=b2.float(),
        )  # fmt: skip
        out = fs.moe_forward(x, weights, ids, experts)
        assert out.shape == (tokens, h) and out.dtype == torch.bfloat16
        assert torch.isfinite(out).all()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err <= 2e-2, f"{tokens} tokens: relative error {err:.2e}"


def test_tactics_for_uses_the_largest_picked_token_count_not_above():
    picks = {2: (3, 30), 8: (4, 40), 64: (5, 50)}
    assert fs.tactics_for(None, 5) is None and fs.tactics_for({}, 5) is None
    assert fs.tactics_for(picks, 1) is None
    assert fs.tactics_for(picks, 2) == [3, 30]
    assert fs.tactics_for(picks, 7) == [3, 30]
    assert fs.tactics_for(picks, 8) == [4, 40]
    assert fs.tactics_for(picks, 10_000) == [5, 50]
