"""Session-wide tiny MoE checkpoints (built once: transformers models, MXFP4 exports)."""

from __future__ import annotations

import pytest
import tiny_moe


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory):
    """name -> folder: gpt_oss / qwen3_moe (dense), their MXFP4 exports (``*_mxfp4``: experts
    and dense layers; ``gpt_oss_experts``: experts only, GPT-OSS's released layout)."""
    root = tmp_path_factory.mktemp("moe")
    folders = {}
    for family in ("gpt_oss", "qwen3_moe"):
        folders[family] = tiny_moe.save(tiny_moe.build_hf(family), str(root / family))
        folders[f"{family}_mxfp4"] = tiny_moe.export_mxfp4(
            folders[family], str(root / f"{family}_mxfp4"), experts_only=False
        )
    folders["gpt_oss_experts"] = tiny_moe.export_mxfp4(
        folders["gpt_oss"], str(root / "gpt_oss_experts"), experts_only=True
    )
    return folders
