"""Architecture name (config.json `architectures`) -> model class; built-ins plus the
``quantfw.models`` entry point group."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from quantfw.registry import Registry

MODELS = Registry("model architecture", "quantfw.models")

_BUILTIN = {
    "LlamaForCausalLM": "quantfw.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "quantfw.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "quantfw.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "quantfw.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "quantfw.models.qwen3_moe:Qwen3MoeForCausalLM",
    "GptOssForCausalLM": "quantfw.models.gpt_oss:GptOssForCausalLM",
}
for _name, _target in _BUILTIN.items():
    MODELS.register(_name, _target)


def register_model(architecture: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: serve checkpoints whose config.json lists `architecture`."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        MODELS.register(architecture, cls)
        return cls

    return wrap


def supported_architectures() -> list[str]:
    return MODELS.names()


def resolve_model_class(architectures: list[str]) -> tuple[type[nn.Module], str]:
    """The first of `architectures` that is registered, with its name."""
    for arch in architectures:
        if arch in MODELS:
            return MODELS.get(arch), arch
    raise ValueError(
        f"unsupported model architecture(s) {architectures or '(none in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
