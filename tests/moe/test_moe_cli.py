"""`quantfw info` on the bundled GPT-OSS-20B config and `quantfw quantize --method mxfp4`."""

from __future__ import annotations

import json
import os

import quantfw
from quantfw.entrypoints.cli import main

BUNDLED = os.path.join(os.path.dirname(quantfw.__file__), "data", "gpt_oss_20b")


def test_info_counts_gpt_oss_20b_and_plans_tp8(capsys):
    assert main(["info", BUNDLED, "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "GptOssForCausalLM" in out and "quantization:   mxfp4" in out
    assert "20914.757 M" in out  # 20.9B logical parameters, experts counted as E * 3 * H * I
    # I = 2880 at tp 8: 12 blocks of 32 per rank (384 features, the last rank half padding)
    assert "w13_blocks (32, 768, 90, 16) uint8" in out and "w2_scales (32, 2880, 12) uint8" in out


def test_quantize_cli_experts_only(moe_checkpoints, tmp_path, capsys):
    out = str(tmp_path / "mx")
    assert (
        main(
            [
                "quantize",
                moe_checkpoints["gpt_oss"],
                "--method",
                "mxfp4",
                "--experts-only",
                "--out",
                out,
            ]
        )
        == 0
    )
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "lm_head",
            "model.embed_tokens",
            "model.layers.*.mlp.router",
            "model.layers.*.self_attn.k_proj",
            "model.layers.*.self_attn.o_proj",
            "model.layers.*.self_attn.q_proj",
            "model.layers.*.self_attn.v_proj",
        ],
    }
    with open(os.path.join(moe_checkpoints["gpt_oss_experts"], "config.json")) as f:
        assert json.load(f)["quantization_config"] == qc
