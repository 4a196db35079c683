"""Generation engine: KV cache, continuous-batching scheduler, sampler, model runner, `LLM`."""

from quantfw.engine.engine import LLMEngine
from quantfw.engine.llm import LLM
from quantfw.engine.sampling_params import SamplingParams
from quantfw.engine.sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
