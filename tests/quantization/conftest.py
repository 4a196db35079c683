"""Tiny dense checkpoints (built once per session), their RTN exports, and the dequantized
transformers reference the quantized models are compared with."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from quantfw.exporter import quantize_checkpoint
from quantfw.kernels import reference
from quantfw.kernels.kbit import format as kbit_format

# hidden 256 / intermediate 512 so that with TP=2 every Row shard (128 / 256 inputs) holds whole
# groups of 64 or 128; 4 heads of 64, 2 kv heads (llama) or 1 (qwen3, replicated under TP=2)
TINY_QUANT = {
    "llama": dict(num_key_value_heads=2),
    "qwen3": dict(num_key_value_heads=1, head_dim=64),
}
COMMON = dict(
    vocab_size=320,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
)

#: export settings by name: the kwargs of quantize_checkpoint
EXPORTS = {
    "awq_g64": dict(method="awq", group_size=64),
    "awq_g128": dict(method="awq", group_size=128),
    "awq_gall": dict(method="awq", group_size=-1),
    "gptq_v1_act_g64": dict(method="gptq", group_size=64, desc_act=True, checkpoint_format="gptq"),
    "gptq_v1_g128_asym": dict(method="gptq", group_size=128, sym=False, checkpoint_format="gptq"),
    "gptq_v2_g128_asym": dict(
        method="gptq", group_size=128, sym=False, checkpoint_format="gptq_v2"
    ),
    "gptq_v2_act_g128": dict(
        method="gptq", group_size=128, desc_act=True, checkpoint_format="gptq_v2"
    ),
    "gptq8_v2_act_g64": dict(
        method="gptq", bits=8, group_size=64, desc_act=True, checkpoint_format="gptq_v2"
    ),
    "gptq3_v1_g128": dict(method="gptq", bits=3, group_size=128, checkpoint_format="gptq"),
    **{f"kbit{bits}": dict(method="kbit", bits=bits) for bits in (2, 3, 4, 5)},
    "kbit4_head": dict(method="kbit", bits=4, lm_head=True),
}


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory):
    """family -> folder of a random fp32 checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cache: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in cache:
            config = AutoConfig.for_model(family, **COMMON, **TINY_QUANT[family])
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            folder = str(tmp_path_factory.mktemp(f"dense_{family}"))
            model.save_pretrained(folder)
            cache[family] = folder
        return cache[family]

    return make


@pytest.fixture(scope="session")
def exported(dense_dir, tmp_path_factory):
    """(family, export name) -> folder of the quantized checkpoint."""
    cache: dict[tuple[str, str], str] = {}

    def make(family: str, name: str) -> str:
        key = (family, name)
        if key not in cache:
            out = str(tmp_path_factory.mktemp(f"{family}_{name}"))
            cache[key] = quantize_checkpoint(dense_dir(family), out, **EXPORTS[name])
        return cache[key]

    return make


def dequantized_weights(folder: str) -> dict[str, torch.Tensor]:
    """Checkpoint module prefix -> dequantized weight [out, in] (fp32), by the reference."""
    with open(os.path.join(folder, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    weights = {}
    if qc["quant_method"] == "kbit":
        for name in tensors:
            if name.endswith(".kbit_planes"):
                prefix = name[: -len(".kbit_planes")]
                t = [tensors[f"{prefix}.kbit_{k}"] for k in ("planes", "absmax", "codebook")]
                weights[prefix] = kbit_format.dequantize(*t)
        return weights
    for name in tensors:
        if not name.endswith(".qweight"):
            continue
        prefix = name[: -len(".qweight")]
        t = {k: tensors[f"{prefix}.{k}"] for k in ("qweight", "qzeros", "scales")}
        if qc["quant_method"] == "awq":
            w = reference.dequantize_awq(t["qweight"], t["qzeros"], t["scales"], qc["group_size"])
        else:
            w = reference.dequantize_gptq(
                t["qweight"],
                t["qzeros"],
                t["scales"],
                tensors[f"{prefix}.g_idx"],
                qc["bits"],
                zero_offset=1 if qc["checkpoint_format"] == "gptq" else 0,
            )
        weights[prefix] = w.t().contiguous()
    return weights


def reference_model(dense: str, quantized: str):
    """The transformers model of `dense` with its linear weights replaced by the dequantized
    weights of `quantized`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    weights = dequantized_weights(quantized)
    modules = dict(model.named_modules())
    for prefix, w in weights.items():
        modules[prefix].weight.data.copy_(w)
    assert weights, "no quantized layers found"
    return model


def kbit_reference_model(
    dense: str, bits: int, codebook: list[float] | None = None, *, lm_head: bool = False
):
    """The transformers model of `dense` with every decoder linear weight (and with `lm_head`,
    the LM head's) replaced by its kbit quantization (the format module's reference), as
    ``quantization="kbit"`` loads it."""
    from transformers import AutoModelForCausalLM

    from quantfw.exporter.checkpoint import QUANTIZED_LINEARS

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    cb = kbit_format.normal_float_codebook(bits) if codebook is None else torch.tensor(codebook)
    count = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in QUANTIZED_LINEARS or (lm_head and name == "lm_head"):
            planes, absmax = kbit_format.quantize(module.weight.data, bits, cb)
            module.weight.data.copy_(kbit_format.dequantize(planes, absmax, cb))
            count += 1
    assert count, "no linear layers found"
    return model


def random_ids(vocab: int, seed: int, batch: int = 2, seq: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def quant_ref():
    """Helpers for the test modules (conftest modules are not importable by name)."""

    class Helpers:
        exports = EXPORTS
        error = staticmethod(relative_error)
        model = staticmethod(reference_model)
        kbit_model = staticmethod(kbit_reference_model)
        weights = staticmethod(dequantized_weights)
        ids = staticmethod(random_ids)

    return Helpers
