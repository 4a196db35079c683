"""One method measured end to end through `LLMEngine` with dummy weights: load time, prefill of
one prompt and time to first token, decode tokens/s per batch size, weight and peak memory; and
the device copy bandwidth that sets the decode floor.

Times are wall-clock around ``engine.step()`` with the device synchronised before and after each
step. Under tensor parallelism every rank builds the engine; the leader drives the steps while the
other ranks run them in the engine's worker loop, and only the leader returns numbers (its own
GPU's memory).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from quantfw import distributed as qdist
from quantfw.bench.methods import BenchMethod
from quantfw.layers.moe import FusedMoE
from quantfw.layers.quantization.base import QuantizeMethodBase
from quantfw.layers.vocab import ParallelLMHead, VocabParallelEmbedding

GIB = 2**30
#: context the decode runs get when --max-model-len is not given (capped at the model's own)
DEFAULT_MAX_MODEL_LEN = 4096

T = TypeVar("T")


@dataclass
class BenchSettings:
    """What `measure_method` runs. Decode sequences start from `decode_context` prompt tokens
    and are timed over `decode_tokens` steps after every sequence has its first token."""

    prompt_len: int = 2048
    batch_sizes: tuple[int, ...] = (1, 16)
    decode_context: int = 128
    decode_tokens: int = 128
    prefill_repeats: int = 7
    max_model_len: int | None = None
    dtype: str = "float16"
    tensor_parallel_size: int | None = None
    cuda_graphs: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(int(b) for b in self.batch_sizes)
        for name in ("prompt_len", "decode_context", "decode_tokens", "prefill_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes {self.batch_sizes} must be >= 1")

    def needed_model_len(self) -> int:
        return max(self.prompt_len, self.decode_context + self.decode_tokens) + 1

    def model_len(self, context_length: int) -> int:
        """max_model_len for a model whose own context is `context_length`."""
        needed = self.needed_model_len()
        chosen = self.max_model_len or min(context_length, max(DEFAULT_MAX_MODEL_LEN, needed))
        if chosen < needed:
            raise ValueError(
                f"max_model_len {chosen} is too short for a {self.prompt_len}-token prompt and "
                f"{self.decode_context}+{self.decode_tokens}-token decode runs (needs {needed})"
            )
        return chosen


# -- devices --------------------------------------------------------------------------------------


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU {platform.machine()}".strip()


def source_revision(path: str | None = None) -> str | None:
    """The git commit of the checkout holding ``path`` (default: this package), with
    ``+modified`` when tracked files differ from it; None outside a git checkout or without
    git. A run's results name the code that produced them."""
    import subprocess

    where = path or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", where, *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    modified = git("status", "--porcelain", "--untracked-files=no")
    return commit + ("+modified" if modified else "")


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device memory bandwidth in bytes/s from timed copies of one buffer into another
    (bytes read + bytes written per copy; 1 GiB on CUDA, 256 MiB on the CPU)."""
    nbytes = nbytes or (GIB if device.type == "cuda" else 256 * 2**20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    sync = synchronizer(device)
    for _ in range(3):
        dst.copy_(src)
    iters = 20 if device.type == "cuda" else 5
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync()
    elapsed = time.perf_counter() - start
    return 2 * src.numel() * src.element_size() * iters / elapsed


# -- memory ---------------------------------------------------------------------------------------


def _storage_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _module_weights(module: nn.Module) -> list[torch.Tensor]:
    tensors = list(module.parameters(recurse=False))
    if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
        tensors += list(module.buffers(recurse=False))
    return tensors


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of weights this rank holds, bytes of them one batch-1 decode step reads).

    Weights are every parameter plus the buffers of quantized layers (their runtime tensors);
    a decode step reads all of them except an input embedding table, of which it reads only a
    few rows (unless the LM head shares it), and a mixture-of-experts layer's experts, of which
    it reads the routed ones (`decode_read_bytes`)."""
    return _held_bytes(model), decode_read_bytes(model, 1)


def _held_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    return sum(_storage_bytes(_module_weights(m), seen) for m in model.modules())


def experts_read_fraction(top_k: int, num_experts: int, batch: int) -> float:
    """The expected fraction of a MoE layer's experts that `batch` tokens route to, with each
    token's `top_k` experts drawn uniformly: ``1 - (1 - top_k / E) ** batch``."""
    return 1.0 - (1.0 - top_k / num_experts) ** batch


def decode_read_bytes(model: nn.Module, batch: int) -> int:
    """Weight bytes one decode step of `batch` sequences reads (see `weight_bytes`)."""
    seen: set[int] = set()
    total = 0.0
    lookup_only: list[torch.Tensor] = []
    head: list[torch.Tensor] = []
    for module in model.modules():
        nbytes = _storage_bytes(_module_weights(module), seen)
        if isinstance(module, FusedMoE):
            nbytes *= experts_read_fraction(module.top_k, module.num_experts, batch)
        total += nbytes
        if isinstance(module, ParallelLMHead):
            head += _module_weights(module)
        elif isinstance(module, VocabParallelEmbedding):
            lookup_only.append(module.weight)
    head_ptrs = {t.untyped_storage().data_ptr() for t in head}
    skipped = [t for t in lookup_only if t.untyped_storage().data_ptr() not in head_ptrs]
    return int(total) - _storage_bytes(skipped, set())


def uncounted_layers(model: nn.Module) -> list[str]:
    """Quantized layers that hold their runtime weights outside parameters and buffers, which
    `weight_bytes` therefore cannot count."""
    return [
        getattr(module, "prefix", name)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)
        and not any(True for _ in module.parameters(recurse=False))
        and not any(True for _ in module.buffers(recurse=False))
    ]


def bound_cache_bytes(model: nn.Module) -> int:
    """Bytes of the tensors modules hold outside their parameters and buffers: the KV cache the
    engine binds to the attention layers."""
    found: list[torch.Tensor] = []
    for module in model.modules():
        own = {id(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))}
        for value in vars(module).values():
            items = value if isinstance(value, (list, tuple)) else (value,)
            found += [t for t in items if isinstance(t, torch.Tensor) and id(t) not in own]
    return _storage_bytes(found, set())


# -- engine phases --------------------------------------------------------------------------------


def leader_session(engine: Any, work: Callable[[], T]) -> T | None:
    """Run `work` on the TP leader while the other ranks execute the steps it sends; returns its
    result on the leader and None elsewhere (the engine's TP protocol, as `LLM.generate` uses)."""
    if not qdist.is_tp_leader():
        engine.runner.worker_loop()
        return None
    try:
        return work()
    finally:
        engine.runner.stop_workers()


def _params(max_tokens: int) -> Any:
    from quantfw.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def time_prefill(engine: Any, prompt: list[int], sync: Callable[[], None]) -> tuple[float, float]:
    """(seconds in the forward steps of one prompt's prefill, seconds from add_request to its
    first token) for a request that stops at that token."""
    sync()
    arrival = time.perf_counter()
    request = engine.add_request(prompt, _params(1))
    forward = 0.0
    for _ in range(len(prompt) + 8):
        sync()
        start = time.perf_counter()
        outputs = engine.step()
        sync()
        forward += time.perf_counter() - start
        if any(o.request_id == request and o.outputs[0].token_ids for o in outputs):
            break
    else:
        raise RuntimeError("the prefill request got no token")
    ttft = time.perf_counter() - arrival
    while engine.has_unfinished():  # nothing left with max_tokens=1; keeps the engine clean
        engine.step()
    return forward, ttft


def time_decode(
    engine: Any, prompts: list[list[int]], new_tokens: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Decode tokens/s of a batch: every prompt is prefilled and has its first token, then the
    steps that generate `new_tokens` more per sequence are timed (tokens counted as produced)."""
    counts = {engine.add_request(p, _params(new_tokens + 1)): 0 for p in prompts}

    def note(outputs: list[Any]) -> int:
        new = 0
        for o in outputs:
            n = len(o.outputs[0].token_ids)
            new += n - counts[o.request_id]
            counts[o.request_id] = n
        return new

    for _ in range(max(len(p) for p in prompts) * len(prompts) + 8):
        note(engine.step())
        if min(counts.values()) > 0:
            break
    else:
        raise RuntimeError("the decode batch did not get its first tokens")
    tokens, elapsed = 0, 0.0
    first_step = engine.stats.steps  # forward steps: an engine step may run a decode window
    while engine.has_unfinished():
        sync()
        start = time.perf_counter()
        outputs = engine.step()
        sync()
        elapsed += time.perf_counter() - start
        tokens += note(outputs)
    steps = engine.stats.steps - first_step
    return {
        "tokens_per_s": tokens / elapsed,
        "ms_per_step": 1e3 * elapsed / steps,
        "steps": steps,
        "tokens": tokens,
    }


def _run_phases(engine: Any, settings: BenchSettings) -> dict[str, Any]:
    sync = synchronizer(engine.device)
    vocab = engine.model_config.hf_config.vocab_size
    generator = torch.Generator().manual_seed(settings.seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    def batch(b: int) -> list[list[int]]:
        return [prompt(settings.decode_context) for _ in range(b)]

    # warm-up: JIT compilation and autotuning of every shape the timed runs use
    time_prefill(engine, prompt(settings.prompt_len), sync)
    for b in settings.batch_sizes:
        time_decode(engine, batch(b), 4, sync)

    runs = [
        time_prefill(engine, prompt(settings.prompt_len), sync)
        for _ in range(settings.prefill_repeats)
    ]
    prefill_s = statistics.median(r[0] for r in runs)
    decode = {
        str(b): time_decode(engine, batch(b), settings.decode_tokens, sync)
        for b in settings.batch_sizes
    }
    return {
        "prefill_ms": 1e3 * prefill_s,
        "prefill_tokens_per_s": settings.prompt_len / prefill_s,
        "ttft_ms": 1e3 * statistics.median(r[1] for r in runs),
        "decode": decode,
    }


def measure_method(
    folder: str,
    method: BenchMethod,
    settings: BenchSettings,
    *,
    bandwidth: float | None = None,
) -> dict[str, Any] | None:
    """Build `method`'s engine from the weight-free config `folder` (dummy weights) and measure
    it. Returns the numbers on the TP leader (None on other ranks); `bandwidth` (bytes/s) adds
    each batch size's decode floor and our fraction of it."""
    from quantfw.config import ModelConfig
    from quantfw.engine import LLMEngine

    context = ModelConfig(folder, dtype=settings.dtype).derived_context_length()
    device = qdist.default_device()
    gc.collect()  # the previous method's engine (reference cycles) before measuring memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    engine = LLMEngine(
        folder,
        dtype=settings.dtype,
        load_format="dummy",
        tensor_parallel_size=settings.tensor_parallel_size,
        max_model_len=settings.model_len(context),
        max_num_seqs=max(settings.batch_sizes),
        cuda_graphs=settings.cuda_graphs,
        tokenizer=None,
        **method.engine_kwargs(),
    )
    build_s = time.perf_counter() - start
    phases = leader_session(engine, lambda: _run_phases(engine, settings))
    if phases is None:
        return None
    held, read = weight_bytes(engine.model)
    cache = bound_cache_bytes(engine.model)
    result: dict[str, Any] = {
        "build_s": build_s,
        "max_model_len": engine.max_model_len,
        "weight_gib": held / GIB,
        "decode_read_gib": read / GIB,
        "kv_cache_gib": cache / GIB,
        "uncounted_weight_layers": len(uncounted_layers(engine.model)),
        "peak_gib": None,
        "peak_excl_kv_cache_gib": None,
        **phases,
    }
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
        result["peak_gib"] = peak / GIB
        result["peak_excl_kv_cache_gib"] = (peak - cache) / GIB
    for b, run in result["decode"].items():
        if bandwidth:
            run["floor_tokens_per_s"] = int(b) * bandwidth / decode_read_bytes(engine.model, int(b))
            run["floor_fraction"] = run["tokens_per_s"] / run["floor_tokens_per_s"]
    return result
