"""The dummy loader: values valid for every method (GPTQ zero points and g_idx, AWQ zeros of any
nibble), deterministic, seeded per parameter name, finite logits in fp32 and fp16. TP=2 against
TP=1 runs under torchrun in test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
from config_only import QUANT_CONFIGS, config_folder

import quantfw
from quantfw.config import ModelConfig
from quantfw.kernels import reference
from quantfw.layers.norm import RMSNorm
from quantfw.loaders import initialize_model
from quantfw.loaders.dummy import load_dummy_weights


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def unprocessed(folder: str, device: str = "cpu") -> torch.nn.Module:
    """The model with its dummy values as a checkpoint would hold them (not yet repacked)."""
    model_config = ModelConfig(folder)
    model = initialize_model(model_config, device)
    load_dummy_weights(model, model_config)
    return model


@pytest.mark.parametrize("name", list(QUANT_CONFIGS))
def test_dummy_model_is_deterministic_and_finite(name, tmp_path, random_ids):
    folder = config_folder(tmp_path, name)
    a = quantfw.load_model(folder, device="cpu", load_format="dummy")
    b = quantfw.load_model(folder, device="cpu", load_format="dummy")
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    ids = random_ids(vocab=320, seq=11)
    with torch.no_grad():
        logits = a(ids)
        assert torch.equal(logits, b(ids))
        half = quantfw.load_model(folder, device="cpu", dtype="float16", load_format="dummy")(ids)
    assert torch.isfinite(logits).all() and torch.isfinite(half).all()
    # every position sees a different distribution: the layers compute something
    assert logits.std() > 0 and (logits[:, 1:] - logits[:, :-1]).abs().max() > 1e-4


def test_every_parameter_is_filled_and_norms_are_near_one(tmp_path):
    model = unprocessed(config_folder(tmp_path, "dense"))
    for name, param in model.named_parameters():
        assert param.abs().sum() > 0, f"{name} was not filled"
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(float(w.min()) >= 0.5 and float(w.max()) <= 1.5 for w in norms)
    linear = model.model.layers[0].mlp.down_proj.weight
    assert float(linear.abs().max()) <= 1e-3 and float(linear.std()) > 1e-4


def test_values_are_seeded_by_parameter_name(tmp_path):
    two = state(unprocessed(config_folder(tmp_path / "two", "dense")))
    three = state(unprocessed(config_folder(tmp_path / "three", "dense", num_hidden_layers=3)))
    for key, value in two.items():
        if key.startswith("model.layers.0.") or key.startswith("model.embed_tokens"):
            assert torch.equal(value, three[key]), key
    q = two["model.layers.0.self_attn.qkv_proj.weight"]
    assert not torch.equal(q, two["model.layers.1.self_attn.qkv_proj.weight"])


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("gptq_v1_sym", {7}),  # symmetric: z = 8, stored minus one
        ("gptq_v1_asym", set(range(15))),  # v1 stores z - 1 and z = 16 does not fit
        ("gptq_v2_act", {8}),
        ("gptq3_v1_asym", set(range(7))),
    ],
)
def test_gptq_dummy_zero_points_fit_the_format(name, allowed, tmp_path):
    cfg = QUANT_CONFIGS[name]
    model = unprocessed(config_folder(tmp_path, name))
    layers = [m for m in model.modules() if hasattr(m, "qzeros")]
    assert layers
    seen: set[int] = set()
    for layer in layers:
        seen |= set(reference.unpack_int32(layer.qzeros, cfg["bits"], dim=1).unique().tolist())
    assert seen == allowed


@pytest.mark.parametrize("name", ["gptq_v1_sym", "gptq_v1_act"])
def test_gptq_dummy_g_idx_is_in_range(name, tmp_path):
    model = unprocessed(config_folder(tmp_path, name))
    for layer in (m for m in model.modules() if hasattr(m, "g_idx")):
        g = layer.g_idx.long()
        num_groups = layer.input_size // 64
        assert layer.scales.shape[0] == num_groups
        assert torch.equal(torch.bincount(g, minlength=num_groups), torch.full((num_groups,), 64))
        sorted_rows = bool((g[1:] >= g[:-1]).all())
        assert sorted_rows != QUANT_CONFIGS[name]["desc_act"], layer.prefix


def test_awq_dummy_zeros_use_every_nibble(tmp_path):
    model = unprocessed(config_folder(tmp_path, "awq"))
    zeros = torch.cat(
        [reference.unpack_awq(m.qzeros).flatten() for m in model.modules() if hasattr(m, "qzeros")]
    )
    assert set(zeros.unique().tolist()) == set(range(16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QUANT_CONFIGS))
def test_dummy_model_on_cuda(name, tmp_path, random_ids, rel_err):
    """Drawn on the GPU, repacked for the GPU kernels (a v1 zero point of 16 used to fail)."""
    folder = config_folder(tmp_path, name)
    ids = random_ids(vocab=320, seq=11).cuda()
    logits = []
    for _ in range(2):
        model = quantfw.load_model(folder, device="cuda", dtype="float16", load_format="dummy")
        assert all(p.device.type == "cuda" for p in model.parameters())
        with torch.no_grad():
            logits.append(model(ids).float())
    assert torch.isfinite(logits[0]).all() and logits[0].std() > 0
    assert rel_err(logits[0], logits[1]) <= 1e-3


@pytest.mark.gpu
def test_dummy_values_do_not_depend_on_the_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    folder = config_folder(tmp_path, "gptq_v1_act")
    first, second = state(unprocessed(folder, "cuda:0")), state(unprocessed(folder, "cuda:1"))
    for key, value in first.items():
        assert torch.equal(value.cpu(), second[key].cpu()), key


def test_dummy_experts_bf16_and_mxfp4_have_one_scale(tmp_path):
    """A bench's bf16-expert twin draws its experts with the rms of the MXFP4 model's dummy
    experts (at +-1e-3 they vanish and greedy dummy sequences collapse onto a few tokens, which
    routed GPT-OSS-20B's twin to a quarter of the experts its MXFP4 model read)."""
    from quantfw.bench.configs import read_hf_config, write_config_folder
    from quantfw.kernels.mxfp4 import format as mxfp4_format

    config, _ = read_hf_config("gpt-oss-20b")
    tiny = dict(config, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                num_local_experts=4, layer_types=["full_attention"])  # fmt: skip
    bf16 = unprocessed(write_config_folder(tiny, str(tmp_path / "bf16"), None))
    mx = unprocessed(write_config_folder(tiny, str(tmp_path / "mx"), config["quantization_config"]))
    dense_experts = bf16.model.layers[0].mlp.experts
    mx_experts = mx.model.layers[0].mlp.experts
    for part in ("w13", "w2"):
        dense = getattr(dense_experts, f"{part}_weight").float()
        deq = mxfp4_format.dequantize(
            getattr(mx_experts, f"{part}_blocks"),
            getattr(mx_experts, f"{part}_scales"),
            torch.float32,
        )
        rms_dense, rms_mx = dense.pow(2).mean().sqrt(), deq.pow(2).mean().sqrt()
        assert abs(rms_dense / rms_mx - 1) < 0.05, (part, float(rms_dense), float(rms_mx))
    # the other dense weights keep the loader's range
    assert float(bf16.model.layers[0].self_attn.o_proj.weight.abs().max()) <= 1e-3
