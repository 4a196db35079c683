"""ModelConfig: dtype, context length (with rope scaling), head_dim, quantization detection."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from quantfw.config import ModelConfig


def _mc(hf_config, **kw):
    return ModelConfig("in-memory", hf_config=hf_config, **kw)


def test_dtype_auto_and_override():
    assert _mc(LlamaConfig(dtype="bfloat16")).dtype == torch.bfloat16
    assert _mc(LlamaConfig(dtype="float16"), dtype="float32").dtype == torch.float32
    assert _mc(LlamaConfig()).dtype == torch.float32


@pytest.mark.parametrize(
    "scaling,expected",
    [
        (None, 4096),
        ({"rope_type": "linear", "factor": 2.0}, 8192),
        ({"rope_type": "dynamic", "factor": 4.0}, 16384),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096),
        ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024}, 8192),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
            4096,
        ),
    ],
)
def test_context_length_from_hf_keys_and_rope_scaling(scaling, expected):
    cfg = LlamaConfig(max_position_embeddings=4096, rope_scaling=scaling)
    assert _mc(cfg).max_model_len == expected


def test_max_model_len_is_checked():
    cfg = LlamaConfig(max_position_embeddings=256)
    assert _mc(cfg, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="exceeds the model's context length 256"):
        _mc(cfg, max_model_len=1000)


def test_head_dim_from_config_or_hidden_over_heads():
    assert _mc(LlamaConfig(hidden_size=256, num_attention_heads=8)).head_dim == 32
    assert _mc(Qwen3Config(hidden_size=256, num_attention_heads=8, head_dim=64)).head_dim == 64
