"""`quantfw generate` prints completions and tokens/s."""

from __future__ import annotations

import json

import pytest

from quantfw.entrypoints.cli import main


def test_generate_json_and_rate(tiny_llama, capsys):
    rc = main(
        [
            "generate",
            tiny_llama,
            "--prompt",
            "hello world",
            "--prompt",
            "the cat",
            "--json",
            "--max-tokens",
            "4",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.strip().splitlines()]
    assert [r["prompt"] for r in lines] == ["hello world", "the cat"]
    assert all(len(r["token_ids"]) <= 4 for r in lines)
    assert "tokens/s" in captured.err


def test_generate_reports_bad_option(tiny_llama, capsys):
    rc = main(["generate", tiny_llama, "--prompt", "hi", "--temperature", "-1"])
    assert rc == 1
    assert "SamplingParams.temperature" in capsys.readouterr().err


def test_generate_quantizes_while_loading_from_the_command_line(tiny_llama, capsys):
    """``--quantization kbit --quantization-args '{...}'``: a dense checkpoint served quantized
    (the kbit head too); a method's missing option and options that are not a JSON object are
    clear errors."""
    argv = ["generate", tiny_llama, "--prompt", "hello", "--max-tokens", "3", "--json"]
    args = '{"bits": 4, "lm_head": true}'
    assert main([*argv, "--quantization", "kbit", "--quantization-args", args]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert 1 <= len(json.loads(line)["token_ids"]) <= 3
    assert main([*argv, "--quantization", "kbit"]) == 1
    assert "--quantization-args '{\"bits\": K}'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--quantization", "kbit", "--quantization-args", "[4]"])
    assert exit_info.value.code == 2
    assert "'[4]' is not a JSON object" in capsys.readouterr().err
