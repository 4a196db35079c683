"""Shared fixtures: tiny random HF checkpoints built with transformers (no hub access)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference|, in float64."""
    ours, reference = ours.double(), reference.double()
    return ((ours - reference).abs().max() / reference.abs().max()).item()


TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def build_hf_model(family: str, seed: int = 0, **overrides):
    """A random transformers causal LM of `family` (llama, qwen2, qwen3, mistral), fp32, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**TINY, **overrides}
    if family == "qwen3":
        kwargs.setdefault("head_dim", 16)
    config = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: (transformers model, folder) for a saved random checkpoint."""

    def make(
        family: str = "llama",
        *,
        name: str | None = None,
        seed: int = 0,
        save_kwargs=None,
        **overrides,
    ):
        model = build_hf_model(family, seed=seed, **overrides)
        folder = tmp_path / (name or family)
        model.save_pretrained(folder, **(save_kwargs or {}))
        return model, str(folder)

    return make


@pytest.fixture
def rel_err():
    return relative_error


@pytest.fixture
def random_ids():
    def make(
        vocab: int = TINY["vocab_size"], batch: int = 2, seq: int = 37, seed: int | None = None
    ):
        g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
        return torch.randint(0, vocab, (batch, seq), generator=g)

    return make
