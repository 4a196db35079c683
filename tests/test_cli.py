"""The `quantfw` console script: --help, info and demo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from quantfw.entrypoints.cli import main


def test_help_lists_subcommands(capsys):
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "info" in out and "demo" in out


def test_info_prints_architecture_and_shard_plan(hf_checkpoint, capsys):
    _, folder = hf_checkpoint("qwen3")
    assert main(["info", folder, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out and "float32" in out and "quantization:   none" in out
    # qkv per rank at tp=2: (4 heads/2 + 2*2 kv heads/2) * head_dim 16 = 64 rows
    assert "QKVParallelLinear" in out and "weight (64, 64)" in out
    n = sum(
        p.numel()
        for p in __import__("safetensors.torch")
        .torch.load_file(os.path.join(folder, "model.safetensors"))
        .values()
    )
    assert f"{n / 1e6:.3f} M" in out
    # kv cache per token per rank: 2 layers x (k + v) x 1 kv head x head_dim 16 x 4 bytes
    assert "kv cache:       0.2 KiB per token per rank (2 full-attention layers)" in out
    assert "tokens fit on" in out


def test_info_with_quantization_args(hf_checkpoint, capsys):
    _, folder = hf_checkpoint("llama")
    args = ["--quantization", "kbit", "--quantization-args", '{"bits": 3, "lm_head": true}']
    assert main(["info", folder, *args]) == 0
    out = capsys.readouterr().out
    assert "quantization:   kbit" in out
    assert re.search(
        r"lm_head +ParallelLMHead +KbitLinearMethod +per rank: weight \(\d+, \d+, 3\)", out
    )


def test_info_error_is_one_line(hf_checkpoint, capsys):
    _, folder = hf_checkpoint("llama")
    cfg = json.loads(Path(os.path.join(folder, "config.json")).read_text())
    cfg["architectures"] = ["NopeForCausalLM"]
    Path(os.path.join(folder, "config.json")).write_text(json.dumps(cfg))
    assert main(["info", folder]) == 1
    assert "unsupported model architecture" in capsys.readouterr().err


def test_demo_console_script_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "quantfw.entrypoints.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "PASS" in proc.stdout


def test_engine_options_offer_every_attention_backend():
    """`--attention-backend` takes each name `select_backend` knows (it once lacked triton)."""
    import argparse

    from quantfw.engine.cli_args import add_engine_args, engine_kwargs
    from quantfw.layers.attention.selector import BACKENDS

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for name in BACKENDS:
        args = p.parse_args(["some-model", "--attention-backend", name])
        assert engine_kwargs(args)["attention_backend"] == name


def test_engine_options_pass_prefill_graph_tokens():
    """`--prefill-graph-tokens N` reaches the engine; left out, the engine's default (None)."""
    import argparse

    from quantfw.engine.cli_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["m"]))["prefill_graph_tokens"] is None
    args = p.parse_args(["m", "--prefill-graph-tokens", "0"])
    assert engine_kwargs(args)["prefill_graph_tokens"] == 0
