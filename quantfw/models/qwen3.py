"""Qwen3: the Llama decoder with per-head RMSNorm on q and k (q_norm / k_norm)."""

from __future__ import annotations

from typing import ClassVar

from quantfw.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm: ClassVar[bool] = True
