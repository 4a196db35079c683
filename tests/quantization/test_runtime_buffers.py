"""Quantized layers keep every runtime tensor as a registered buffer: ``model.to()`` and
``named_buffers()`` see them, no tensor hides in a plain attribute, and the bytes of parameters
plus buffers are what each method's `runtime_nbytes` says its layout takes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import quantfw
from quantfw.kernels import w4a16
from quantfw.layers.linear import LinearBase
from quantfw.layers.quantization import int4


def hidden_tensors(model: torch.nn.Module) -> list[str]:
    """Tensors held by plain attributes of modules (directly or in a dataclass)."""
    found = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_"):
                continue
            values = (
                [getattr(value, f.name) for f in dataclasses.fields(value)]
                if dataclasses.is_dataclass(value)
                else [value]
            )
            if any(isinstance(v, torch.Tensor) for v in values):
                found.append(f"{name}.{attr}")
    return found


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def check_accounting(model: torch.nn.Module) -> None:
    assert hidden_tensors(model) == []
    claimed = 0
    for module in model.modules():
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if isinstance(module, LinearBase):
            claimed += module.quant_method.runtime_nbytes(module) + nbytes([module.bias])
        else:
            claimed += nbytes(own)
    held = nbytes(model.parameters()) + nbytes(model.buffers())
    assert held == claimed
    model.to("meta")
    assert all(t.device.type == "meta" for t in model.buffers())
    assert all(t.device.type == "meta" for t in model.parameters())


@pytest.mark.parametrize(
    "name", ["awq_g64", "gptq_v1_act_g64", "gptq8_v2_act_g64", "gptq3_v1_g128"]
)
def test_awq_gptq_runtime_tensors_are_buffers(name, exported):
    model = quantfw.load_model(exported("llama", name), dtype="float32", device="cpu")
    runtime = {n.rpartition(".")[2] for n, _ in model.named_buffers()}
    assert runtime >= (
        {"int4_weight"}
        if "gptq8" not in name and "gptq3" not in name
        else {"qweight", "qzeros", "scales", "g_idx"}
    )
    check_accounting(model)


@pytest.mark.parametrize("name", ["awq_g64", "gptq_v1_act_g64"])
def test_w4a16_runtime_is_buffers(name, exported, quant_ref):
    """The W4A16 runtime (CUDA in practice) registered on CPU: its tensors are buffers, the
    layer still computes the reference result through w4a16_matmul's CPU twin."""
    folder = exported("llama", name)
    model = quantfw.load_model(folder, dtype="float32", device="cpu")
    weights = quant_ref.weights(folder)
    layer = model.model.layers[0].mlp.down_proj
    w = weights["model.layers.0.mlp.down_proj"]
    state = {k: v.clone() for k, v in load_state(folder, "model.layers.0.mlp.down_proj").items()}
    if "g_idx" in state:
        packed = w4a16.repack_gptq(
            state["qweight"], state["qzeros"], state["scales"], state["g_idx"], 64, True, "gptq"
        )
    else:
        packed = w4a16.repack_awq(state["qweight"], state["qzeros"], state["scales"], 64)
    for buf in ("int4_weight", "int4_scales_and_zeros", "int4_gather"):
        delattr(layer, buf)
    int4.attach_w4a16(layer, packed, ())
    x = torch.randn(3, layer.input_size)
    want = x.double() @ w.double().t()
    got = layer(x).double()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3
    assert {n for n, _ in layer.named_buffers()} >= {"w4a16_qweight", "w4a16_scales_zeros"}
    check_accounting(model)


def load_state(folder: str, prefix: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(f"{folder}/model.safetensors")
    return {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}


@pytest.mark.parametrize("quantized", [True, False])
def test_kbit_runtime_tensors_are_buffers(quantized, exported, dense_dir):
    if quantized:
        model = quantfw.load_model(exported("qwen3", "kbit3"), dtype="float32", device="cpu")
    else:
        model = quantfw.load_model(
            dense_dir("qwen3"), dtype="float32", device="cpu", quantization="kbit",
            quantization_args={"bits": 5},
        )  # fmt: skip
    runtime = {n.rpartition(".")[2] for n, _ in model.named_buffers()}
    assert runtime >= {"kbit_qweight", "kbit_scales", "kbit_codebook"}
    layer = model.model.layers[0].mlp.gate_up_proj
    bits = 3 if quantized else 5
    # 1024 x 256 weight: 8 blocks per row, no padding; K bit-plane words + 1 E4M4 byte per block
    assert layer.quant_method.runtime_nbytes(layer) == 1024 * 8 * (4 * bits + 1) + 4 * 2**bits
    check_accounting(model)


def test_moving_a_model_drops_the_kept_runtime_weights(exported):
    """The quantize methods keep one weight wrapper per layer across calls
    (`base.kept_runtime`); ``model.to()`` drops it with the layer's old buffers: a cast gets a
    wrapper over the new buffers (the int32 words stay the same tensor, the codebook does not),
    and a move frees the old buffers at once rather than at the layer's next call."""
    import gc
    import weakref

    model = quantfw.load_model(exported("qwen3", "kbit3"), dtype="float32", device="cpu")
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, layer.input_size_per_partition)
    first = layer(x)
    kept = layer.quant_method._weight(layer)
    assert layer.quant_method._weight(layer) is kept  # one wrapper across calls

    model.to(torch.float64)
    assert layer.kbit_qweight is kept.qweight and layer.kbit_codebook is not kept.codebook
    cast = layer.quant_method._weight(layer)
    assert cast is not kept and cast.codebook is layer.kbit_codebook
    again = layer(x.double())
    assert again.dtype == torch.float64
    torch.testing.assert_close(again.float(), first, rtol=1e-5, atol=1e-6)

    old = weakref.ref(layer.kbit_qweight)
    del kept, cast
    model.to("meta")
    gc.collect()
    assert old() is None, "a kept wrapper still holds the layer's old packed weight"
