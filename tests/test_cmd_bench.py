"""`quantfw bench`: config sources, the method table, memory accounting, and the command end to
end on a tiny bundled config (CPU; under torchrun with two gloo ranks; on CUDA when present)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from config_only import config_folder

import quantfw
from quantfw.bench.configs import bundled_configs, read_hf_config, write_config_folder
from quantfw.bench.measure import (
    BenchSettings,
    bound_cache_bytes,
    decode_read_bytes,
    experts_read_fraction,
    source_revision,
    uncounted_layers,
    weight_bytes,
)
from quantfw.bench.methods import method_table, parse_methods
from quantfw.entrypoints.cli import main

TINY_RUN = [
    "--prompt-len",
    "24",
    "--batch-sizes",
    "1,3",
    "--decode-context",
    "8",
    "--decode-tokens",
    "5",
    "--prefill-repeats",
    "1",
]


def test_bundled_qwen3_8b_config_has_the_public_shape(tmp_path, capsys):
    assert {"qwen3-8b", "tiny-llama"} <= set(bundled_configs())
    config, label = read_hf_config("Qwen3-8B")
    assert label == "qwen3-8b"
    expected = {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "architectures": ["Qwen3ForCausalLM"],
    }
    assert {k: config[k] for k in expected} == expected
    folder = write_config_folder(config, str(tmp_path / "q"))
    assert main(["info", folder]) == 0
    assert "8190.735 M" in capsys.readouterr().out  # Qwen3-8B's parameter count


def test_config_sources(tmp_path):
    folder = config_folder(tmp_path / "f", "awq")
    from_folder, label = read_hf_config(folder)
    assert label == "f" and from_folder["hidden_size"] == 256
    assert read_hf_config(os.path.join(folder, "config.json"))[0] == from_folder
    written_folder = write_config_folder(from_folder, str(tmp_path / "g"))
    written = json.loads(Path(written_folder, "config.json").read_text())
    assert "quantization_config" not in written  # a checkpoint's method never leaks into fp16
    with pytest.raises(ValueError, match="not a bundled config"):
        read_hf_config(str(tmp_path / "missing" / "config.json"))
    with pytest.raises(ValueError, match="cannot fetch config.json of hub repo 'nobody/none'"):
        read_hf_config("nobody/none")  # HF_HUB_OFFLINE=1 in the tests


def test_method_table():
    table = method_table(64)
    assert table["gptq"].checkpoint_config == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 64,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    assert table["kbit3"].engine_kwargs() == {
        "quantization": "kbit",
        "quantization_args": {"bits": 3},
    }
    assert table["kbit4-head"].engine_kwargs() == {
        "quantization": "kbit",
        "quantization_args": {"bits": 4, "lm_head": True},
    }
    assert table["fp16"].unavailable() is None and table["awq"].unavailable() is None
    with pytest.raises(ValueError, match="unknown method.*fp8.*supported: fp16, awq"):
        parse_methods("fp16,fp8")
    with pytest.raises(ValueError, match="twice"):
        parse_methods("awq,awq")
    with pytest.raises(ValueError, match="too short"):
        BenchSettings(prompt_len=300).model_len(256)
    assert BenchSettings(prompt_len=100).model_len(40960) == 4096


def test_mxfp4_keeps_the_checkpoints_unquantized_modules(tmp_path):
    """Benched as mxfp4, GPT-OSS keeps what its checkpoint leaves unquantized (attention,
    router, embedding, LM head): the method's quantization_config goes over the model's own."""
    config, _ = read_hf_config("gpt-oss-20b")
    mxfp4 = method_table()["mxfp4"]
    written = mxfp4.checkpoint_config_for(config)
    assert written == config["quantization_config"]
    assert "model.layers.*.self_attn" in written["modules_to_not_convert"]
    assert mxfp4.checkpoint_config_for({"architectures": ["X"]}) == {"quant_method": "mxfp4"}
    other = {"quantization_config": {"quant_method": "awq", "modules_to_not_convert": ["x"]}}
    assert mxfp4.checkpoint_config_for(other) == {"quant_method": "mxfp4"}
    assert method_table()["fp16"].checkpoint_config_for(config) is None
    small = {**config, "num_hidden_layers": 2, "layer_types": config["layer_types"][:2]}
    small.update(vocab_size=512, hidden_size=256, intermediate_size=256, num_local_experts=4)
    small.update(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    small.update(num_experts_per_tok=2, pad_token_id=None, eos_token_id=None)
    folder = write_config_folder(small, str(tmp_path / "g"), written)
    model = quantfw.load_model(folder, load_format="dummy", dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    assert [p.dtype for p in attn.parameters() if p.dim() == 2] == [torch.bfloat16] * 2
    experts = dict(model.model.layers[0].mlp.experts.named_parameters())
    assert experts["w13_blocks"].dtype == torch.uint8


def test_a_moe_decode_step_reads_the_routed_experts(tmp_path):
    """The decode floor of a MoE model counts the experts a step routes to, not all of them."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
    import tiny_moe

    folder = tiny_moe.save(tiny_moe.build_hf("qwen3_moe"), str(tmp_path / "moe"))
    model = quantfw.load_model(folder, load_format="dummy")
    moe = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
    experts = sum(
        t.numel() * t.element_size() for m in moe for t in (*m.parameters(), *m.buffers())
    )
    held, read = weight_bytes(model)
    embedding = model.model.embed_tokens.weight
    dense = held - experts - embedding.numel() * embedding.element_size()
    assert experts > 0 and experts_read_fraction(2, 8, 1) == 0.25
    assert abs(read - (dense + experts * 0.25)) <= len(moe)
    assert abs(decode_read_bytes(model, 16) - (dense + experts * (1 - 0.75**16))) <= len(moe)


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_what_a_decode_step_reads(tmp_path, tied):
    model = quantfw.load_model(
        config_folder(tmp_path, "dense", tie_word_embeddings=tied), load_format="dummy"
    )
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    embedding = model.model.embed_tokens.weight
    held, read = weight_bytes(model)
    assert held == sum(params.values())
    skipped = 0 if tied else embedding.numel() * embedding.element_size()
    assert read == held - skipped
    quantized = quantfw.load_model(config_folder(tmp_path / "q", "awq"), load_format="dummy")
    q_held, _ = weight_bytes(quantized)
    buffers = sum(b.numel() * b.element_size() for n, b in quantized.named_buffers() if "int4" in n)
    assert buffers > 0 and q_held > buffers  # the repacked int4 tensors count as weights
    assert bound_cache_bytes(model) == 0 and uncounted_layers(quantized) == []
    layer = quantized.model.layers[1].mlp.down_proj
    layer.hidden_weight = layer.int4_weight  # a runtime tensor kept as a plain attribute
    for name in [n for n, _ in layer.named_buffers()]:
        delattr(layer, name)
    assert uncounted_layers(quantized) == ["model.layers.1.mlp.down_proj"]


def _report(out_dir) -> dict:
    (path,) = [p for p in os.listdir(out_dir) if p.endswith(".json")]
    with open(os.path.join(out_dir, path)) as f:
        return json.load(f)


def _check_measured(
    report: dict, batch_sizes: list[int], decode_tokens: int, names=("fp16", "awq", "gptq")
) -> None:
    for name in names:
        m = report["methods"][name]
        assert m["status"] == "ok", m
        assert m["prefill_ms"] > 0 and m["ttft_ms"] >= m["prefill_ms"] and m["build_s"] > 0
        for b in batch_sizes:
            run = m["decode"][str(b)]
            assert run["tokens"] == b * decode_tokens and run["steps"] == decode_tokens
            assert run["floor_fraction"] == pytest.approx(
                run["tokens_per_s"] / run["floor_tokens_per_s"]
            )
    fp16, quantized = report["methods"]["fp16"], report["methods"][names[1]]
    ratio = quantized["vs_fp16"]["weight"]
    assert ratio == pytest.approx(quantized["weight_gib"] / fp16["weight_gib"])
    assert 0.1 < ratio < 0.6  # 4-bit linears, fp32 embedding and head
    assert fp16["vs_fp16"]["decode_speed"] == {str(b): 1.0 for b in batch_sizes}


def test_bench_command_on_a_tiny_config(tmp_path, capsys):
    out = tmp_path / "results"
    args = ["bench", "tiny-llama", "--methods", "fp16,awq,gptq,kbit4", "--dtype", "float32"]
    assert main([*args, *TINY_RUN, "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    report = _report(out)
    _check_measured(report, [1, 3], 5)
    kbit = report["methods"]["kbit4"]
    if kbit["status"] == "skipped":  # until the kbit method is registered
        assert "'kbit' is not registered" in kbit["reason"] or "quantization_args" in kbit["reason"]
        assert f"kbit4: skipped: {kbit['reason']}" in printed
    else:
        assert kbit["status"] == "ok", kbit
    assert report["command"].startswith("quantfw bench tiny-llama --methods fp16,awq,gptq,kbit4")
    assert report["tensor_parallel_size"] == 1 and report["copy_bandwidth_gb_s"] > 0
    assert "prefill ms" in printed and "batch 3 [% of floor]" in printed
    awq = json.dumps(report["methods"]["awq"]["quantization_config"], sort_keys=True)
    assert f"awq: quantization_config {awq}" in printed and '"quant_method": "awq"' in awq
    stems = {os.path.splitext(p)[0] for p in os.listdir(out)}
    assert len(stems) == 1 and next(iter(stems)).startswith("bench-tiny-llama-CPU")
    markdown = Path(out, next(iter(stems)) + ".md").read_text()
    assert report["command"] in markdown and report["date"] in markdown
    assert report["quantfw"] == quantfw.__version__
    assert f"- quantfw: {quantfw.__version__} (source " in markdown
    assert report["source"] == source_revision()
    has_chart = os.path.exists(os.path.join(out, next(iter(stems)) + ".png"))
    assert has_chart == (importlib.util.find_spec("matplotlib") is not None)


def test_source_revision_names_the_checkouts_commit(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("the tests do not run from a git checkout")
    revision = source_revision(here)
    assert revision.split("+")[0] == head.stdout.strip()
    assert revision.endswith("+modified") == bool(
        subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    assert source_revision(str(tmp_path)) is None  # not a checkout


def test_bench_rejects_bad_input(capsys):
    assert main(["bench", "tiny-llama", "--methods", "fp8"]) == 1
    assert "unknown method(s) ['fp8']" in capsys.readouterr().err
    assert main(["bench", "no-such-model"]) == 1
    assert "not a bundled config" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_under_torchrun_tp2(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "quantfw.entrypoints.cli", "bench", config_folder(tmp_path / "m", "dense")]
    cmd += ["--methods", "fp16,gptq-act", "--dtype", "float32", "--group-size", "64"]
    cmd += [*TINY_RUN, "--out-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("decode tok/s") == 1  # rank 0 alone prints
    report = _report(out)
    assert report["tensor_parallel_size"] == 2
    assert report["command"].startswith("torchrun --nproc-per-node=2 -m quantfw.entrypoints.cli")
    _check_measured(report, [1, 3], 5, names=("fp16", "gptq-act"))


@pytest.mark.gpu
def test_bench_command_on_cuda(tmp_path):
    out = tmp_path / "results"
    methods = "fp16,awq,gptq,gptq-asym,gptq-v2,gptq-act"
    args = ["bench", config_folder(tmp_path / "m", "dense"), "--methods", methods]
    assert main([*args, "--group-size", "64", *TINY_RUN, "--out-dir", str(out)]) == 0
    report = _report(out)
    _check_measured(report, [1, 3], 5)
    for name, m in report["methods"].items():
        assert m["status"] == "ok", m
        assert m["peak_gib"] >= m["weight_gib"] and m["kv_cache_gib"] > 0
        # weights GiB and the floor count parameters and buffers: the GPU runtime tensors of
        # quantized layers must be registered buffers (issue 17), not plain attributes
        assert m["uncounted_weight_layers"] == 0, f"{name}: {m['uncounted_weight_layers']} layers"
    assert report["device"] == torch.cuda.get_device_name()
