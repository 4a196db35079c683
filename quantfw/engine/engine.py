"""LLMEngine: requests in, tokens out, one step at a time.

Owns the model, tokenizer, KV cache, scheduler, runner and sampler. `add_request` queues a
prompt, `step` runs one forward step (new requests join between steps) and returns the outputs
of the requests that advanced. Under tensor parallelism only the TP leader runs this logic; the
other ranks follow in `ModelRunner.worker_loop`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from quantfw import distributed as qdist
from quantfw.api import load_model_with_config
from quantfw.engine.cuda_graphs import resolve_prefill_graph_tokens
from quantfw.engine.kv_cache import KVCache
from quantfw.engine.runner import ModelRunner
from quantfw.engine.sampler import plain_greedy, sample
from quantfw.engine.sampling_params import SamplingParams
from quantfw.engine.scheduler import Scheduler
from quantfw.engine.sequence import CompletionOutput, RequestOutput, Sequence
from quantfw.kernels.common import triton_available
from quantfw.layers.attention import FlashInferBackend, select_backend
from quantfw.layers.rotary import RotaryEmbedding


@dataclass
class EngineStats:
    """Counters the server exports on /metrics."""

    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival: float = field(default_factory=time.perf_counter)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def load_tokenizer(model: str, revision: str | None = None) -> Any | None:
    """The checkpoint's tokenizer, or None when the folder has none (token-id prompts only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, revision=revision)
    except (OSError, ValueError, TypeError):
        return None


def eos_token_ids(model: str, hf_config: Any, tokenizer: Any | None) -> set[int]:
    from transformers import GenerationConfig

    eos: Any = None
    with contextlib.suppress(OSError, ValueError):
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


#: Decode steps the GPU runs back to back for batches of plain greedy sequences (with CUDA graphs)
DEFAULT_DECODE_WINDOW = 8
#: Steps that prefill, of up to this many tokens, replay CUDA graphs (with CUDA graphs; capped
#: at max_num_batched_tokens and max_model_len)
DEFAULT_PREFILL_GRAPH_TOKENS = 512


class LLMEngine:
    def __init__(
        self,
        model: str,
        *,
        quantization: str | None = None,
        quantization_args: dict[str, Any] | None = None,
        dtype: str | torch.dtype = "auto",
        tensor_parallel_size: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        gpu_memory_utilization: float = 0.9,
        cuda_graphs: bool | None = None,
        decode_window: int | None = None,
        prefill_graph_tokens: int | None = None,
        attention_backend: str = "auto",
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        load_format: str = "auto",
        revision: str | None = None,
        download_dir: str | None = None,
        device: str | torch.device | None = None,
        tokenizer: Any | None = None,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
        self.model_config, self.model = load_model_with_config(
            model,
            quantization=quantization,
            quantization_args=quantization_args,
            dtype=dtype,
            device=device,
            load_format=load_format,
            revision=revision,
            download_dir=download_dir,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
        )
        self.max_model_len = self.model_config.max_model_len
        self.device = next(self.model.parameters()).device
        if not hasattr(self.model, "forward_cached"):
            raise ValueError(
                f"{type(self.model).__name__} has no cache-aware forward_cached(); "
                "the engine cannot run it (model(input_ids) still works)"
            )
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.reserve(self.max_model_len)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model, revision)
        self.eos_token_ids = eos_token_ids(model, self.model_config.hf_config, self.tokenizer)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, max_num_seqs)
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs "
                f"({max_num_seqs}) so every running sequence can decode each step"
            )
        self.kv_cache = KVCache(
            self.model,
            block_size=block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            dtype=self.model_config.dtype,
            device=self.device,
            memory_utilization=gpu_memory_utilization,
            num_blocks=num_gpu_blocks,
        )
        uses_sinks = any(
            layer.sinks is not None for g in self.kv_cache.groups for layer in g.layers
        )
        backend = select_backend(
            attention_backend, self.device, self.model_config.dtype, uses_sinks=uses_sinks
        )
        if isinstance(backend, FlashInferBackend):
            layer = self.kv_cache.groups[0].layers[0]
            backend.configure(
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_dim,
                self.model_config.dtype,
                self.kv_cache.windows,
            )
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        graph_backend = backend
        if cuda_graphs and not backend.graph_capturable:
            graph_backend = select_backend(
                "triton" if triton_available() else "sdpa", self.device, self.model_config.dtype
            )
        if decode_window is None:
            decode_window = DEFAULT_DECODE_WINDOW if cuda_graphs else 1
        if decode_window < 1 or (decode_window > 1 and not cuda_graphs):
            raise ValueError(
                f"decode_window={decode_window} must be >= 1, and 1 without CUDA graphs"
            )
        self.decode_window = decode_window
        prefill_graph_tokens = resolve_prefill_graph_tokens(
            prefill_graph_tokens,
            DEFAULT_PREFILL_GRAPH_TOKENS,
            graph_backend=graph_backend if cuda_graphs else None,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            backend,
            self.device,
            cuda_graphs=cuda_graphs,
            max_graph_batch=max_num_seqs,
            graph_backend=graph_backend,
            max_window=decode_window,
            prefill_graph_tokens=prefill_graph_tokens,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        )
        self.requests: dict[str, _Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        #: asked between the steps of a decode window whether requests wait to join (a server
        #: sets it, `AsyncEngine` to its inbox): True ends the window after the steps already
        #: queued, so an arrival waits about two steps instead of a whole window. One GPU only:
        #: under tensor parallelism every rank runs whole windows.
        self.arrivals_waiting: Callable[[], bool] | None = None

    # -- requests -----------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"{self.model_config.model!r} has no tokenizer: pass token ids, not text"
            )
        return list(self.tokenizer(prompt)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, the context (max_model_len) holds "
                f"{self.max_model_len} including at least one generated token"
            )
        vocab = self.model_config.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(
                f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        seqs = []
        for i in range(params.n):
            generator = None
            if not params.greedy:
                seed = params.seed + i if params.seed is not None else None
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,)).item())
                generator = torch.Generator().manual_seed(seed)
            seq = Sequence(request_id, i, ids, params, generator)
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, text, ids, params, seqs)
        self.stats.requests_added += 1
        self.stats.prompt_tokens += len(ids)
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a request (e.g. its client went away); unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.stats.requests_aborted += 1
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step (or a decode window of several); outputs of the requests that got
        tokens (finished ones included)."""
        window = self.scheduler.schedule_window(
            self.decode_window, self.max_model_len, lambda s: plain_greedy(s.params)
        )
        if window is not None:
            return self._step_window(*window)
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        plan, batch = scheduled
        logits = self.runner.execute(batch)
        self.stats.steps += 1
        to_sample = []
        for seq, n in plan:
            seq.num_computed += n
            if seq.num_computed == seq.num_tokens:
                to_sample.append(seq)
        try:
            sampled = sample(logits, to_sample)  # one batched pass (one host sync)
        except Exception:
            sampled = None  # a request's sampling raised: go row by row to fail only that one

        def sample_row(i: int, seq: Sequence) -> None:
            token, lp = sampled[i] if sampled is not None else sample(logits[i][None], [seq])[0]
            self._append(seq, token, lp)

        return self._advance(to_sample, sample_row)

    def _step_window(self, plan: list[tuple[Sequence, int]], batch: Any, window: int):
        """Run `window` greedy decode steps on the GPU, then append each sequence's tokens up
        to the one that finishes it (the rest of its window is dropped)."""
        stop = self.arrivals_waiting if qdist.get_tp_size() == 1 else None
        tokens = self.runner.execute(batch, window, stop).tolist()  # [steps][B]: one host sync
        self.stats.steps += len(tokens)

        def append_window(b: int, seq: Sequence) -> None:
            for j in range(len(tokens)):
                if seq.finished:
                    break
                seq.num_computed += 1
                self._append(seq, tokens[j][b], None)

        return self._advance([seq for seq, _ in plan], append_window)

    def _advance(
        self, seqs: list[Sequence], advance: Callable[[int, Sequence], None]
    ) -> list[RequestOutput]:
        """``advance(i, seq)`` for each sequence of the step; a request whose sequence raises is
        failed alone (its sequences finish with reason "error"), the others go on."""
        touched: dict[str, _Request] = {}
        for i, seq in enumerate(seqs):
            req = self.requests.get(seq.request_id)
            if seq.finished:  # a sibling of this sequence failed earlier in this loop
                continue
            try:
                advance(i, seq)
            except Exception as e:  # this request's own fault: fail it alone, the others go on
                if req is None:
                    raise
                self._fail(req, e)
            if req is not None:
                touched[req.request_id] = req
        return self._outputs(touched)

    def _outputs(self, touched: dict[str, _Request]) -> list[RequestOutput]:
        outputs = [self._output(req) for req in touched.values()]
        for req in touched.values():
            if req.finished:
                del self.requests[req.request_id]
                self.stats.requests_finished += 1
        return outputs

    def _fail(self, req: _Request, error: Exception) -> None:
        req.error = f"{type(error).__name__}: {error}"
        self.stats.requests_failed += 1
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "error")

    def _append(self, seq: Sequence, token: int, lp: Any) -> None:
        params = seq.params
        seq.output_token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        self.stats.generation_tokens += 1
        reason = None
        if (
            not params.ignore_eos and token in self.eos_token_ids
        ) or token in params.stop_token_ids:
            reason = "stop"
        seq.text = self.decode(seq.output_token_ids)
        if reason is None and params.stop:
            reason = self._match_stop_string(seq)
        if reason is None and (
            len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    @staticmethod
    def _match_stop_string(seq: Sequence) -> str | None:
        # only text near the end can hold a stop string that just appeared
        hits = [(seq.text.find(s), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        i, s = min(hits)
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        return "stop"

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            delta = seq.text[seq.emitted_chars :]
            if not seq.finished:
                delta = _hold_back(delta, seq.params.stop)
            seq.emitted_chars += len(delta)
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                    delta_text=delta,
                )
            )
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outs,
            finished=req.finished,
            error=req.error,
        )

    def shutdown(self) -> None:
        """Release the other TP ranks from their worker loop."""
        self.runner.stop_workers()


def _hold_back(delta: str, stops: list[str]) -> str:
    """Keep back a trailing partial character and any tail that could start a stop string."""
    while delta.endswith("\ufffd"):
        delta = delta[:-1]
    for stop in stops:
        for k in range(min(len(stop) - 1, len(delta)), 0, -1):
            if delta.endswith(stop[:k]):
                delta = delta[:-k]
                break
    return delta
