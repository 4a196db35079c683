"""Weight-free model folders (config.json only) for the dummy loader and `quantfw bench`."""

from __future__ import annotations

from typing import Any

from quantfw.bench.configs import write_config_folder

#: hidden 256 / intermediate 512 so TP=2 Row shards hold whole groups of 64; one kv head
#: (replicated under TP=2); vocab 320 is padded differently at TP=1 (320) and TP=2 (384)
TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 320,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _gptq(**overrides: Any) -> dict[str, Any]:
    base = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True}
    return {**base, "checkpoint_format": "gptq", **overrides}


#: name -> quantization_config written into config.json (None: unquantized)
QUANT_CONFIGS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True},
    "gptq_v1_sym": _gptq(),
    "gptq_v1_asym": _gptq(sym=False),
    "gptq_v1_act": _gptq(sym=False, desc_act=True),
    "gptq_v2_act": _gptq(desc_act=True, checkpoint_format="gptq_v2"),
    "gptq3_v1_asym": _gptq(bits=3, sym=False),
}


def config_folder(path, name: str = "dense", **overrides: Any) -> str:
    """A folder holding only the tiny Qwen3 config.json with QUANT_CONFIGS[name]."""
    return write_config_folder({**TINY_QWEN3, **overrides}, str(path), QUANT_CONFIGS[name])
