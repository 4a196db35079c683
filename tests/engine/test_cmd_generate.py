"""`quantfw generate` prints completions and tokens/s."""

from __future__ import annotations

import json

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
