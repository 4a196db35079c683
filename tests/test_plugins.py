"""The example plugin package installs, and its entry points bring a quantization method and a
model that a checkpoint needs; plugin errors name the plugin; decorators register in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantfw.layers.quantization import QuantizationConfig, register_quantization_method
from quantfw.registry import PluginLoadError, Registry

PLUGIN = os.path.join(os.path.dirname(__file__), "plugins", "quantfw_toy_plugin")

CHECK = r"""
import sys, torch, quantfw
from quantfw.layers.quantization import QUANTIZATION_METHODS
from quantfw.models import supported_architectures
assert "toy_int8" in QUANTIZATION_METHODS.names(), QUANTIZATION_METHODS.names()
assert "ToyForCausalLM" in supported_architectures()
model = quantfw.load_model(sys.argv[1], device="cpu")
assert type(model).__name__ == "ToyForCausalLM"
layer = model.model.layers[0].mlp.gate_up_proj
assert type(layer.quant_method).__name__ == "ToyInt8LinearMethod" and layer.qweight.dtype == torch.int8
assert type(model.model.layers[0].self_attn.o_proj.quant_method).__name__ == "UnquantizedLinearMethod"
ids = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(ids), sys.argv[3])
"""


def _quantize_to_toy_int8(hf_model, folder):
    """Write hf_model as a toy_int8 checkpoint; returns the dequantized state dict."""
    tensors, dequantized = {}, {}
    for name, t in hf_model.state_dict().items():
        is_linear = name.endswith("_proj.weight") and "o_proj" not in name
        if is_linear:
            scale = t.abs().amax(dim=1).clamp(min=1e-8) / 127
            q = torch.round(t / scale[:, None]).clamp(-127, 127).to(torch.int8)
            base = name.removesuffix(".weight")
            tensors[base + ".qweight"] = q
            tensors[base + ".weight_scale"] = scale.float()
            dequantized[name] = q.float() * scale[:, None]
        else:
            tensors[name] = t.contiguous()
            dequantized[name] = t
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    cfg = hf_model.config.to_dict()
    cfg["architectures"] = ["ToyForCausalLM"]
    cfg["quantization_config"] = {
        "quant_method": "toy_int8",
        "bits": 8,
        "modules_to_not_convert": ["o_proj"],
    }
    Path(os.path.join(folder, "config.json")).write_text(json.dumps(cfg))
    return dequantized


@pytest.mark.slow
def test_installed_plugin_serves_a_checkpoint(hf_checkpoint, rel_err, tmp_path):
    site = tmp_path / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            PLUGIN,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    hf_model, _ = hf_checkpoint("llama")
    folder = tmp_path / "toy"
    folder.mkdir()
    dequantized = _quantize_to_toy_int8(hf_model, folder)
    hf_model.load_state_dict(dequantized)
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 19))
    torch.save(ids, tmp_path / "ids.pt")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHECK,
            str(folder),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        expected = hf_model(ids).logits
    assert rel_err(torch.load(tmp_path / "out.pt"), expected) <= 1e-4


def test_plugin_import_error_names_the_plugin(tmp_path, monkeypatch):
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[quantfw.test_group]\nbroken = no_such_module_xyz:Thing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("test thing", "quantfw.test_group")
    with pytest.raises(
        PluginLoadError, match=r"plugin 'broken' \(no_such_module_xyz:Thing\).*failed to import"
    ):
        registry.names()


def test_decorator_registration_and_case_insensitive_lookup():
    from quantfw.layers.quantization import (
        get_quantization_config_class,
        resolve_quantization_config,
    )

    @register_quantization_method("Unit_Test_Method")
    class UnitConfig(QuantizationConfig):
        def __init__(self, bits):
            self.bits = bits

        @classmethod
        def get_name(cls):
            return "unit_test_method"

        @classmethod
        def from_config(cls, config):
            return cls(config["bits"])

        def get_quant_method(self, layer, prefix):
            return None

    assert get_quantization_config_class("UNIT_TEST_METHOD") is UnitConfig
    cfg = resolve_quantization_config(
        {"quant_method": "unit_test_method", "bits": 4, "modules_to_not_convert": ["lm_head"]},
        quantization_args={"bits": 3},
    )
    assert cfg.bits == 3 and cfg.modules_to_not_convert == ["lm_head"]
    with pytest.raises(TypeError, match="not a QuantizationConfig subclass"):
        register_quantization_method("bad")(object)


def test_modules_to_not_convert_for_fused_layers():
    from quantfw.layers.quantization import is_layer_skipped

    mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert is_layer_skipped("model.layers.0.self_attn.qkv_proj", ["self_attn"], mapping)
    assert is_layer_skipped("model.layers.1.mlp.down_proj", ["layers.1"], mapping)
    assert not is_layer_skipped("model.layers.11.mlp.down_proj", ["layers.1"], mapping)
    with pytest.raises(ValueError, match="only some of them"):
        is_layer_skipped("model.layers.0.self_attn.qkv_proj", ["q_proj"], mapping)
