"""Bad checkpoints and options give clear errors that name the thing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantfw


def _rewrite(folder: str, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight.*missing shard\(s\) k"
    ):
        quantfw.load_model(folder, device="cpu")


def test_missing_plain_parameter(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    _rewrite(folder, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"got no data.*'model\.norm\.weight'"):
        quantfw.load_model(folder, device="cpu")


def test_unexpected_tensor_names_file(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    _rewrite(
        folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.randn(4, 4)})
    )
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.mlp\.extra_proj\.weight'.*maps to no parameter.*model\.safetensors",
    ):
        quantfw.load_model(folder, device="cpu")


def test_wrong_shape_names_tensor_parameter_and_shapes(hf_checkpoint):
    _, folder = hf_checkpoint("llama")

    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = torch.randn(100, 64)

    _rewrite(folder, edit)
    with pytest.raises(ValueError) as info:
        quantfw.load_model(folder, device="cpu")
    msg = str(info.value)
    for part in (
        "model.layers.0.mlp.up_proj.weight",
        "gate_up_proj.weight",
        "(100, 64)",
        "(128, 64)",
        "model.safetensors",
    ):
        assert part in msg, (part, msg)


def test_truncated_safetensors(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    path = os.path.join(folder, "model.safetensors")
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        quantfw.load_model(folder, device="cpu")


def test_unknown_architecture(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.loads(Path(cfg_path).read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    Path(cfg_path).write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"MadeUpForCausalLM.*supported:.*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        quantfw.load_model(folder, device="cpu")


def test_unknown_quant_method(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.loads(Path(cfg_path).read_text())
    cfg["quantization_config"] = {"quant_method": "NotAMethod", "bits": 4}
    Path(cfg_path).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown quantization method 'notamethod'; registered:"):
        quantfw.load_model(folder, device="cpu")
    with pytest.raises(ValueError, match=r"unknown quantization method 'alsonot'"):
        quantfw.load_model(hf_checkpoint("qwen2")[1], device="cpu", quantization="alsonot")


def test_quantization_disagreement(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.loads(Path(cfg_path).read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    Path(cfg_path).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization='gptq'.*quant_method='awq'"):
        quantfw.load_model(folder, device="cpu", quantization="gptq")


def test_bad_options(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    with pytest.raises(ValueError, match="unknown load_format 'gguf'"):
        quantfw.load_model(folder, device="cpu", load_format="gguf")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        quantfw.load_model(folder, device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="without a quantization method"):
        quantfw.load_model(folder, device="cpu", quantization_args={"bits": 4})
    with pytest.raises(ValueError, match="cannot read the HF config"):
        quantfw.load_model(os.path.join(folder, "nope"), device="cpu")


def test_tp_size_must_divide_world(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    with pytest.raises(
        ValueError, match="tensor_parallel_size=2 must be >= 1 and divide the world size 1"
    ):
        quantfw.load_model(folder, device="cpu", tensor_parallel_size=2)
