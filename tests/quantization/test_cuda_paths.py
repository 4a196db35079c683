"""The CUDA paths of AWQ and GPTQ against the fp32 reference dequantization, layer by layer
(GPU only): our Triton W4A16 kernels for 4-bit fp16/bf16, torch tinygemm (bf16 inside) for
4-bit float32, the dequantize fallback for 3-bit."""

from __future__ import annotations

import pytest
import torch

import quantfw
from quantfw.layers.linear import LinearBase

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
NAMES = ["awq_g64", "awq_gall", "gptq_v1_act_g64", "gptq_v2_g128_asym", "gptq3_v1_g128"]


def _reference_weight(prefix: str, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    head, _, leaf = prefix.rpartition(".")
    parts = FUSED.get(leaf, (leaf,))
    return torch.cat([weights[f"{head}.{p}"] for p in parts])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2), (torch.float32, 1e-2)]
)
@pytest.mark.parametrize("name", NAMES)
def test_cuda_layers_match_reference(name, dtype, tol, exported, quant_ref):
    folder = exported("llama", name)
    model = quantfw.load_model(folder, dtype=dtype, device="cuda")
    weights = quant_ref.weights(folder)
    checked = 0
    for prefix, layer in model.named_modules():
        if not isinstance(layer, LinearBase) or prefix.endswith("lm_head"):
            continue
        w = _reference_weight(prefix, weights).double()
        for m in (1, 7, 64):
            x = torch.randn(m, layer.input_size, dtype=dtype, device="cuda")
            out = torch.full((m, w.shape[0]), float("nan"), dtype=dtype, device="cuda")
            with torch.no_grad():
                out.copy_(layer(x))
            want = x.double().cpu() @ w.t()
            err = ((out.double().cpu() - want).abs().max() / want.abs().max()).item()
            assert err <= tol, f"{name} {prefix} M={m} {dtype}: relative error {err:.2e}"
        checked += 1
    assert checked == 8
    fused = name != "gptq3_v1_g128"
    runtime = "w4a16_qweight" if dtype != torch.float32 else "int4_weight"
    assert all(hasattr(m, runtime) == fused for m in _quantized(model))


def _quantized(model):
    return [m for m in model.modules() if isinstance(m, LinearBase) and not hasattr(m, "weight")]
