"""`ToyForCausalLM`: a Llama-shaped model registered under its own architecture name."""

from __future__ import annotations

from quantfw.models.llama import LlamaForCausalLM


class ToyForCausalLM(LlamaForCausalLM):
    """Declares the same data as Llama; exists to show a model arriving through an entry point."""
