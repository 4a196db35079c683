"""`LLM`: offline batched generation and chat on top of `LLMEngine`."""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from quantfw import distributed as qdist
from quantfw.engine.engine import LLMEngine
from quantfw.engine.sampling_params import SamplingParams
from quantfw.engine.sequence import RequestOutput

Prompt = str | list[int]
Messages = list[dict[str, Any]]


def _normalize_prompts(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError(
            "prompts must be a string, a list of token ids, or a non-empty list of those"
        )
    return list(prompts)


class LLM:
    """Load a checkpoint and generate.

    ``LLM(model, quantization=..., dtype=..., tensor_parallel_size=..., max_model_len=...,
    max_num_seqs=..., gpu_memory_utilization=...)``; further keyword arguments go to
    `LLMEngine` (``max_num_batched_tokens``, ``cuda_graphs``, ``attention_backend``,
    ``load_format``, ``device``...). Under torchrun every rank constructs the LLM and makes the
    same calls; the leader schedules and samples, and every rank returns the same outputs.
    """

    def __init__(
        self,
        model: str,
        *,
        quantization: str | None = None,
        dtype: str | torch.dtype = "auto",
        tensor_parallel_size: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        gpu_memory_utilization: float = 0.9,
        **engine_kwargs: Any,
    ):
        self.engine = LLMEngine(
            model,
            quantization=quantization,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            **engine_kwargs,
        )

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs in prompt order."""
        prompts = _normalize_prompts(prompts)
        if not qdist.is_tp_leader():
            self.engine.runner.worker_loop()
            result = qdist.broadcast_object(None)
            if isinstance(result, Exception):  # the leader's error, raised on every rank
                raise result
            return result  # type: ignore[return-value]
        try:
            result = self._run(prompts, sampling_params, use_tqdm)
        except Exception as e:
            result = e
        finally:
            self.engine.runner.stop_workers()
        if qdist.get_tp_size() > 1:
            qdist.broadcast_object(result)
        if isinstance(result, Exception):
            raise result
        return result

    def _run(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts"
                )
            params_list = sampling_params
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params_list):
                ids.append(self.engine.add_request(p, sp))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        failed = [done[i] for i in ids if done[i].error]
        if failed:
            raise RuntimeError(
                f"{len(failed)} of {len(ids)} requests failed; the first, "
                f"{failed[0].request_id!r}: {failed[0].error}"
            )
        return [done[i] for i in ids]

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's
        chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            apply_chat_template(
                self.engine.tokenizer, conv, add_generation_prompt, chat_template_kwargs
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def apply_chat_template(
    tokenizer: Any,
    messages: Messages,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat_template; use generate() with a prompt")
    ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        **(chat_template_kwargs or {}),
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
