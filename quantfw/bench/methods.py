"""The methods `quantfw bench` compares and how each builds its model from a weight-free config:
a checkpoint ``quantization_config`` written into config.json (AWQ, GPTQ: dummy packed weights),
or a method that quantizes at load time (``quantization=``, ``quantization_args=``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True)
class BenchMethod:
    """One benchmarked method. `name` ``fp16`` is the unquantized model in the run's dtype."""

    name: str
    quant_method: str | None = None
    #: written as config.json's quantization_config (a pre-quantized checkpoint's settings)
    checkpoint_config: dict[str, Any] | None = None
    #: given to the engine for a method that quantizes at load time
    quantization_args: dict[str, Any] | None = field(default=None)

    def checkpoint_config_for(self, model_config: dict[str, Any]) -> dict[str, Any] | None:
        """The quantization_config to write for a model whose config.json is `model_config`:
        this method's, over the model's own when that names the same method, so a checkpoint's
        other settings stay as its users get them (GPT-OSS keeps attention, router, embedding
        and LM head unquantized through ``modules_to_not_convert``)."""
        if self.checkpoint_config is None:
            return None
        own = model_config.get("quantization_config")
        if isinstance(own, dict) and own.get("quant_method") == self.quant_method:
            return {**own, **self.checkpoint_config}
        return dict(self.checkpoint_config)

    def engine_kwargs(self) -> dict[str, Any]:
        """The LLMEngine arguments that select this method (beyond the config folder)."""
        if self.quantization_args is None:
            return {}
        return {"quantization": self.quant_method, "quantization_args": self.quantization_args}

    def unavailable(self) -> str | None:
        """Why this install cannot run the method, or None when it can."""
        if self.quant_method is None:
            return None
        from quantfw.layers.quantization import QUANTIZATION_METHODS

        if self.quant_method not in QUANTIZATION_METHODS:
            return (
                f"quantization method {self.quant_method!r} is not registered in this install "
                f"(registered: {', '.join(QUANTIZATION_METHODS.names())})"
            )
        if self.quantization_args is not None:
            from quantfw.engine import LLMEngine

            if "quantization_args" not in inspect.signature(LLMEngine).parameters:
                return "LLMEngine takes no quantization_args, which this method needs"
        return None


def method_table(group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, BenchMethod]:
    """Every method name `--methods` accepts."""

    def awq() -> dict[str, Any]:
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        }

    def gptq(**overrides: Any) -> dict[str, Any]:
        base = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        }
        return {**base, **overrides}

    table = [
        BenchMethod("fp16"),
        BenchMethod("awq", "awq", awq()),
        BenchMethod("gptq", "gptq", gptq()),
        BenchMethod("gptq-asym", "gptq", gptq(sym=False)),
        BenchMethod("gptq-v2", "gptq", gptq(checkpoint_format="gptq_v2")),
        BenchMethod("gptq-act", "gptq", gptq(desc_act=True)),
        *(BenchMethod(f"kbit{k}", "kbit", quantization_args={"bits": k}) for k in (2, 3, 4, 5)),
        *(
            BenchMethod(f"kbit{k}-head", "kbit", quantization_args={"bits": k, "lm_head": True})
            for k in (2, 3, 4, 5)
        ),
        BenchMethod("mxfp4", "mxfp4", {"quant_method": "mxfp4"}),
        BenchMethod(
            "mxfp4-flashinfer",
            "mxfp4",
            {"quant_method": "mxfp4"},
            quantization_args={"moe_backend": "flashinfer"},
        ),
    ]
    return {m.name: m for m in table}


def parse_methods(spec: str, group_size: int = DEFAULT_GROUP_SIZE) -> list[BenchMethod]:
    """``"fp16,awq,gptq"`` -> methods, in order; an unknown name lists the known ones."""
    table = method_table(group_size)
    names = [n.strip().lower() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError("--methods is empty; choose from " + ", ".join(table))
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; supported: {', '.join(table)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--methods lists a method twice: {spec!r}")
    return [table[n] for n in names]
