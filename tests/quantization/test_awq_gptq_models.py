"""AWQ and GPTQ exports of tiny Llama / Qwen3 models load through quantfw and match transformers
with the dequantized weights; bad checkpoints fail with clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from checkpoint_edit import edited_copy

import quantfw
from quantfw.layers.quantization.awq import AWQConfig, AWQLinearMethod
from quantfw.layers.quantization.gptq import GPTQConfig, GPTQLinearMethod
from quantfw.models.utils import WeightLoadError

TOL = 1e-3
CASES = [
    ("llama", name)
    for name in (
        "awq_g64",
        "awq_g128",
        "awq_gall",
        "gptq_v1_act_g64",
        "gptq_v1_g128_asym",
        "gptq_v2_g128_asym",
        "gptq_v2_act_g128",
        "gptq8_v2_act_g64",
        "gptq3_v1_g128",
    )
] + [("qwen3", name) for name in ("awq_g64", "gptq_v1_act_g64", "gptq_v2_g128_asym")]
TP_CASES = [
    ("llama", "awq_g64"),
    ("llama", "gptq_v1_act_g64"),
    ("llama", "gptq_v2_g128_asym"),
    ("qwen3", "awq_g128"),
    ("qwen3", "gptq_v2_act_g128"),
]


def _quantized_layers(model):
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), (AWQLinearMethod, GPTQLinearMethod))
    ]


@pytest.mark.parametrize("family,name", CASES)
def test_matches_dequantized_transformers(family, name, exported, dense_dir, quant_ref):
    folder = exported(family, name)
    model = quantfw.load_model(folder, dtype="float32", device="cpu")
    hf = quant_ref.model(dense_dir(family), folder)
    ids = quant_ref.ids(hf.config.vocab_size, seed=hash(name) % 1000)
    with torch.no_grad():
        got, want = model(ids), hf(ids).logits
    err = quant_ref.error(got, want)
    assert err <= TOL, f"{family}/{name}: relative error {err:.3e}"
    layers = _quantized_layers(model)
    assert len(layers) == 4 * hf.config.num_hidden_layers
    fused = quant_ref.exports[name].get("bits", 4) == 4
    assert all((getattr(m, "int4_weight", None) is not None) == fused for m in layers)


@pytest.mark.parametrize("name", ["awq_g64", "gptq_v1_act_g64", "gptq8_v2_act_g64"])
def test_no_full_precision_weight_after_loading(name, exported):
    model = quantfw.load_model(exported("llama", name), dtype="float32", device="cpu")
    for layer in _quantized_layers(model):
        dense = layer.input_size_per_partition * layer.output_size_per_partition
        tensors = list(layer.named_parameters(recurse=False)) + list(
            layer.named_buffers(recurse=False)
        )
        for tname, t in tensors:
            if t is not None and t.is_floating_point() and tname != "bias":
                assert t.numel() * 8 <= dense, f"{layer.prefix}.{tname} {tuple(t.shape)}"
        assert not hasattr(layer, "weight")


_TP_SCRIPT = textwrap.dedent(
    """
    import sys, torch, quantfw
    from quantfw import distributed as qdist
    ids, out, folders = sys.argv[1], sys.argv[2], sys.argv[3:]
    ids = torch.load(ids)
    logits = {}
    for folder in folders:
        model = quantfw.load_model(folder, dtype="float32", device="cpu")
        with torch.no_grad():
            logits[folder] = model(ids)
    if qdist.get_tp_rank() == 0:
        torch.save(logits, out)
    """
)


@pytest.mark.slow
def test_tensor_parallel_2_equals_tp_1(exported, quant_ref, tmp_path):
    folders = [exported(f, n) for f, n in TP_CASES]
    ids = quant_ref.ids(320, seed=7, seq=9)
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "tp.py").write_text(_TP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(tmp_path / "tp.py"), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"), *folders]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tp2 = torch.load(tmp_path / "out.pt")
    for (family, name), folder in zip(TP_CASES, folders):
        model = quantfw.load_model(folder, dtype="float32", device="cpu")
        with torch.no_grad():
            tp1 = model(ids)
        err = quant_ref.error(tp2[folder], tp1)
        assert err <= 1e-5, f"{family}/{name}: TP=2 vs TP=1 relative error {err:.3e}"


@pytest.mark.parametrize(
    "name,edit,match",
    [
        ("gptq_v2_act_g128", {"bits": 5}, r"bits=5 is not supported; supported: \[2, 3, 4, 8\]"),
        ("awq_g64", {"bits": 5}, r"bits=5 is not supported; supported: 4"),
        ("awq_g64", {"version": "gemv"}, r"version='gemv' is not supported; supported: 'gemm'"),
        ("gptq_v2_act_g128", {"checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
        ("gptq_v2_act_g128", {"lm_head": True}, r"GPTQ: lm_head=true \(a quantized LM head\)"),
    ],
)
def test_bad_config(name, edit, match, exported, tmp_path):
    folder = edited_copy(exported("llama", name), tmp_path / "bad", config=edit)
    with pytest.raises(ValueError, match=match):
        quantfw.load_model(folder, dtype="float32", device="cpu")


@pytest.mark.parametrize(
    "name,edit,match",
    [
        # scales/qzeros hold 4 groups of 64 but the config says 128: 2 groups expected
        ("awq_g64", {"group_size": 128}, r"model\.layers\.0\.\S+\.(qzeros|scales)'.*does not fit"),
        # 4-bit qweight [32, out] read as 8-bit: [64, out] expected
        ("gptq_v2_act_g128", {"bits": 8}, r"layers\.0\.\S+\.(qweight|qzeros)'.*does not fit"),
    ],
)
def test_checkpoint_contradicts_config(name, edit, match, exported, tmp_path):
    folder = edited_copy(exported("llama", name), tmp_path / "bad", config=edit)
    with pytest.raises(WeightLoadError, match=match):
        quantfw.load_model(folder, dtype="float32", device="cpu")


def test_fused_parts_must_share_g_idx(exported, tmp_path):
    def shuffle_k(state):
        key = "model.layers.1.self_attn.k_proj.g_idx"
        state[key] = state[key].flip(0).contiguous()

    folder = edited_copy(exported("llama", "gptq_v1_act_g64"), tmp_path / "bad", tensors=shuffle_k)
    with pytest.raises(
        WeightLoadError, match=r"qkv_proj\.g_idx.*fused part '[qkv]' carries a different value"
    ):
        quantfw.load_model(folder, dtype="float32", device="cpu")


class _FakeShard(torch.nn.Module):
    """What create_weights reads off a layer on TP rank 1 of 2."""

    prefix = "model.layers.0.mlp.down_proj"
    tp_rank, tp_size = 1, 2


def _noop_loader(param, tensor, *shard):
    raise AssertionError("not called")


@pytest.mark.parametrize(
    "config",
    [
        AWQConfig(group_size=128),
        GPTQConfig(group_size=128, desc_act=False),
    ],
)
def test_tp_shard_that_splits_a_group_is_an_error(config):
    method = AWQLinearMethod(config) if isinstance(config, AWQConfig) else GPTQLinearMethod(config)
    with pytest.raises(
        ValueError,
        match=r"layer model\.layers\.0\.mlp\.down_proj: input size per partition 192 "
        r"\(tensor_parallel_size 2\) is not a multiple of 128",
    ):
        method.create_weights(
            _FakeShard(), 192, [256], 384, 256, torch.float32, weight_loader=_noop_loader
        )


def test_act_order_row_shard_keeps_groups_whole():
    """With desc_act, a Row shard of 192 rows is fine: scales stay whole, g_idx is sharded."""
    layer = _FakeShard()
    GPTQLinearMethod(GPTQConfig(group_size=128, desc_act=True)).create_weights(
        layer, 192, [256], 384, 256, torch.float32, weight_loader=_noop_loader
    )
    assert layer.scales.shape == (3, 256) and not hasattr(layer.scales, "input_dim")
    assert layer.g_idx.shape == (192,) and layer.g_idx.input_dim == 0


def test_awq_shard_that_splits_a_packed_int32_is_an_error():
    with pytest.raises(ValueError, match=r"output size per partition 12 .* multiple of 8"):
        AWQLinearMethod(AWQConfig(group_size=64)).create_weights(
            _FakeShard(), 128, [12], 256, 24, torch.float32, weight_loader=_noop_loader
        )


def test_cli_sharded_export_loads_like_single_file(dense_dir, exported, tmp_path, quant_ref):
    from quantfw.entrypoints.cli import main
    from quantfw.exporter import quantize_checkpoint

    single = exported("llama", "gptq_v1_act_g64")
    out = quantize_checkpoint(
        dense_dir("llama"),
        str(tmp_path / "sharded"),
        **quant_ref.exports["gptq_v1_act_g64"],
        max_shard_size=300_000,
    )
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    ids = quant_ref.ids(320, seed=3)
    with torch.no_grad():
        a = quantfw.load_model(out, dtype="float32", device="cpu")(ids)
        b = quantfw.load_model(single, dtype="float32", device="cpu")(ids)
    assert torch.equal(a, b)
    argv = ["quantize", dense_dir("llama"), "--method", "awq", "--group-size", "64"]
    assert main([*argv, "--out", str(tmp_path / "cli")]) == 0
    with open(tmp_path / "cli" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    assert (
        main(["quantize", dense_dir("llama"), "--method", "awq", "--desc-act", "--out", "x"]) == 1
    )
