"""What a model is (ModelConfig) and how to load it (LoadConfig)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from quantfw.layers.quantization import QuantizationConfig, resolve_quantization_config

LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")

_DTYPES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}

# HF config keys that hold the trained context length, most specific first.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
    "model_max_length",
)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; supported: auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


@dataclass
class LoadConfig:
    """Where and how weights are read."""

    load_format: str = "auto"
    download_dir: str | None = None
    revision: str | None = None
    ignore_patterns: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"unknown load_format {self.load_format!r}; supported: {', '.join(LOAD_FORMATS)}"
            )


class ModelConfig:
    """The HF config plus what quantfw derives from it: dtype, context length, head_dim and the
    quantization method."""

    def __init__(
        self,
        model: str,
        *,
        revision: str | None = None,
        dtype: str | torch.dtype = "auto",
        quantization: str | None = None,
        quantization_args: dict[str, Any] | None = None,
        max_model_len: int | None = None,
        download_dir: str | None = None,
        hf_config: Any = None,
    ):
        self.model = model
        self.revision = revision
        self.hf_config = (
            hf_config
            if hf_config is not None
            else load_hf_config(model, revision=revision, cache_dir=download_dir)
        )
        self.architectures: list[str] = list(getattr(self.hf_config, "architectures", None) or [])
        self.dtype = self._resolve_dtype(dtype)
        self.quant_config: QuantizationConfig | None = resolve_quantization_config(
            self.checkpoint_quantization_config(), quantization, quantization_args
        )
        self.max_model_len = self._resolve_max_model_len(max_model_len)

    def checkpoint_quantization_config(self) -> dict[str, Any] | None:
        qc = getattr(self.hf_config, "quantization_config", None)
        if qc is None:
            return None
        if isinstance(qc, dict):
            return dict(qc)
        return dict(qc.to_dict())

    def _resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        if not (isinstance(dtype, str) and dtype == "auto"):
            return parse_dtype(dtype)
        config_dtype = getattr(self.hf_config, "dtype", None) or getattr(
            self.hf_config, "torch_dtype", None
        )
        if config_dtype is None:
            return torch.float32
        return parse_dtype(config_dtype)

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        if head_dim:
            return int(head_dim)
        return self.hf_config.hidden_size // self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or (
            self.hf_config.num_attention_heads
        )

    def derived_context_length(self) -> int:
        """Trained context length from the HF keys, scaled by the rope scaling factor where the
        scaling type extends the context (not for llama3/longrope, whose keys already do)."""
        text_config = getattr(self.hf_config, "text_config", None) or self.hf_config
        length = None
        for key in _CONTEXT_KEYS:
            value = getattr(text_config, key, None)
            if value is not None:
                length = int(value)
                break
        if length is None:
            raise ValueError(
                f"cannot tell the context length of {self.model!r}: none of {_CONTEXT_KEYS} is set"
            )
        from quantfw.layers.rotary import rope_parameters

        params = rope_parameters(text_config) if hasattr(text_config, "hidden_size") else {}
        rope_type = params.get("rope_type", "default")
        factor = params.get("factor")
        if factor and rope_type not in ("default", "llama3", "longrope", "su"):
            base = length
            if rope_type == "yarn":
                base = params.get("original_max_position_embeddings", length)
            length = max(length, int(base * factor))
        return length

    def _resolve_max_model_len(self, max_model_len: int | None) -> int:
        derived = self.derived_context_length()
        if max_model_len is None:
            return derived
        if max_model_len > derived:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context length {derived}"
            )
        return max_model_len


def load_hf_config(model: str, *, revision: str | None = None, cache_dir: str | None = None) -> Any:
    """The transformers config of a local folder or hub repo id, with a clear error."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    from transformers import AutoConfig

    if not os.path.isdir(model):
        try:
            validate_repo_id(model)
        except HFValidationError:
            raise ValueError(
                f"cannot read the HF config of {model!r}: it is neither an existing folder "
                "nor a valid Hugging Face repo id ('name' or 'org/name')"
            ) from None
    try:
        return AutoConfig.from_pretrained(model, revision=revision, cache_dir=cache_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the HF config of {model!r}: {e}") from e
