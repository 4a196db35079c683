"""A kbit gated pair (gate_up with ``gated=True``): its repacked rows are interleaved so that the
mma kernel can activate them in its epilogue, and every way out (``forward``, ``forward_gated``)
still computes the [gate | up] layer the checkpoint describes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantfw.kernels import fused, kbit
from quantfw.layers.activation import SiluAndMul, SwigluOAIAndMul
from quantfw.layers.linear import MergedColumnParallelLinear
from quantfw.layers.quantization.kbit import KbitConfig


def _gated_layer(inter: int, hidden: int, bias: bool, gated: bool, seed: int):
    config = KbitConfig(bits=4)
    config.checkpoint_is_quantized = False  # quantized while loading
    layer = MergedColumnParallelLinear(
        hidden, [inter, inter], bias=bias, gated=gated, quant_config=config, prefix="mlp.gate_up"
    )
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    if bias:
        layer.weight_loader(layer.bias, torch.randn(inter, generator=g), 0)
        layer.weight_loader(layer.bias, torch.randn(inter, generator=g), 1)
    # the dense layer the checkpoint describes, through the quantization's round trip
    dense = torch.cat([gate, up]).reshape(2 * inter, hidden // 32, 32)
    planes, absmax = kbit.quantize(dense, 4, config.codebook)
    want_w = kbit.dequantize(planes, absmax, config.codebook).reshape(2 * inter, hidden)
    want_b = layer.bias.detach().clone() if bias else None
    layer.quant_method.process_weights_after_loading(layer)
    return layer, want_w, want_b


@pytest.mark.parametrize("inter,bias", [(64, False), (96, True), (48, True)])
def test_gated_pair_interleaves_rows_and_still_computes_its_layer(inter, bias):
    layer, w, b = _gated_layer(inter, 64, bias, True, inter)
    # interleaved where the rows make whole groups of 32 per part
    assert layer.kbit_gate_up_interleave == (32 if inter % 32 == 0 else 0)
    x = torch.randn(3, 64, dtype=torch.float32)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = layer(x)
    assert got.shape == (3, 2 * inter)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    for act in (SiluAndMul(), SwigluOAIAndMul(1.702, 7.0)):
        gated = layer.forward_gated(x, act)
        ref = act(want.float())
        assert gated.shape == (3, inter)
        assert ((gated.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-5


def test_interleave_helpers_invert_each_other():
    t = torch.randn(2 * 96, 5)
    il = fused.interleave_gate_up(t, 32)
    assert torch.equal(il[:32], t[:32]) and torch.equal(il[32:64], t[96:128])
    assert torch.equal(fused.deinterleave_gate_up(il, 32, dim=0), t)
    y = torch.randn(4, 2 * 96)
    assert torch.equal(
        fused.silu_and_mul(fused.interleave_gate_up(y, 32, -1), 32), fused.silu_and_mul(y)
    )


def test_gated_pair_errors_name_the_layer():
    with pytest.raises(ValueError, match="mlp.x.*two equal output sizes"):
        MergedColumnParallelLinear(64, [32, 64], gated=True, prefix="mlp.x")
    layer = MergedColumnParallelLinear(64, [32, 32], prefix="mlp.y")
    with pytest.raises(ValueError, match="mlp.y.*gated=True"):
        layer.forward_gated(torch.randn(1, 64), SiluAndMul())
    with pytest.raises(ValueError, match="interleave=5"):
        fused.silu_and_mul(torch.randn(2, 64), 5)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 5])
def test_gpu_gated_pair_through_the_layer(bits):
    """On CUDA in fp16 the gated layer's `forward_gated` (the mma kernel's epilogue at K = 4,
    the separate kernel at K = 5) matches its plain `forward` then the activation, at decode
    and prefill sizes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    config = KbitConfig(bits=bits)
    config.checkpoint_is_quantized = False
    half = torch.float16
    with torch.device("cuda"):
        layer = MergedColumnParallelLinear(
            512, [1024, 1024], gated=True, quant_config=config, params_dtype=half, prefix="g"
        )
        for part in (0, 1):
            layer.weight.weight_loader(layer.weight, torch.randn(1024, 512, dtype=half), part)
            layer.bias.weight_loader(layer.bias, torch.randn(1024, dtype=half), part)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.kbit_gate_up_interleave == 32
    for m in (1, 9, 16, 300):
        x = torch.randn(m, 512, device="cuda", dtype=torch.float16)
        for act in (SiluAndMul(), SwigluOAIAndMul(1.702, 7.0)):
            want = act(layer(x).float())
            got = layer.forward_gated(x, act).float()
            assert ((got - want).norm() / want.norm()).item() < 2e-3, (bits, m, act)
