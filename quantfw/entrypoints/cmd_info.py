"""``quantfw info MODEL``: architecture, dtype, quantization, parameter count and shard plan,
computed on the meta device (no weights are read)."""

from __future__ import annotations

import argparse

from torch import nn

from quantfw import distributed as qdist
from quantfw.config import ModelConfig
from quantfw.engine.cli_args import add_quantization_args
from quantfw.layers.linear import LinearBase
from quantfw.layers.moe import FusedMoE
from quantfw.layers.vocab import VocabParallelEmbedding
from quantfw.loaders.base import initialize_model
from quantfw.models.registry import resolve_model_class


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "info", help="describe a checkpoint and its tensor-parallel shard plan"
    )
    p.add_argument("model", help="HF repo id or local folder")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to plan for")
    add_quantization_args(p)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--revision", default=None)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of device memory the engine may use (for the KV-cache estimate)",
    )
    p.set_defaults(func=run)


def _logical_params(model: nn.Module) -> int:
    """Parameters as the unquantized model would count them (quantized linears as in*out)."""
    total = 0
    seen: set[int] = set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        if isinstance(module, LinearBase):
            total += module.input_size * module.output_size
            if module.bias is not None:
                total += module.bias.numel() * module.tp_size
        elif isinstance(module, VocabParallelEmbedding) and own:
            total += module.num_embeddings * module.embedding_dim  # without vocab padding
        elif isinstance(module, FusedMoE):
            e, h, i = module.num_experts, module.hidden_size, module.intermediate_size
            total += e * 3 * h * i + (e * (2 * i + h) if module.has_bias else 0)
        else:
            continue
        seen.update(id(p) for p in own)
    for p in model.parameters():
        if id(p) not in seen:
            total += p.numel()
    return total


def shard_plan(model_config: ModelConfig, tp: int) -> tuple[nn.Module, list[str]]:
    """The model as TP rank 0 of `tp` builds it (on meta), and one line per layer kind."""
    with qdist.simulated_tp(tp, 0):
        model = initialize_model(model_config, "meta")
    lines, seen = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, (LinearBase, VocabParallelEmbedding, FusedMoE)):
            continue
        key = name.split(".")[-1]
        if key in seen:
            continue
        seen.add(key)
        method = getattr(module, "quant_method", None)
        shapes = ", ".join(
            f"{pname} {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
            for pname, p in module.named_parameters(recurse=False)
        )
        lines.append(
            f"  {key:<14} {type(module).__name__:<28} {type(method).__name__ if method else '-':<26} "
            f"per rank: {shapes}"
        )
    return model, lines


def kv_cache_lines(model: nn.Module, mc: ModelConfig, utilization: float) -> list[str]:
    """KV-cache bytes per token on one rank, and how many tokens fit on this machine's device
    beside the rank's weights (the engine sizes the cache the same way)."""
    import torch

    from quantfw.engine.kv_cache import attention_layers, available_memory_bytes

    layers = attention_layers(model)
    if not layers:
        return []
    elem = torch.empty((), dtype=mc.dtype).element_size()
    full = [a for a in layers if a.sliding_window is None or a.sliding_window >= mc.max_model_len]
    per_token = sum(2 * a.num_kv_heads * a.head_dim * elem for a in full)
    lines = [
        f"kv cache:       {per_token / 1024:.1f} KiB per token per rank "
        f"({len(full)} full-attention layers"
        + (
            f", {len(layers) - len(full)} sliding-window layers hold only their window)"
            if len(full) < len(layers)
            else ")"
        )
    ]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = available_memory_bytes(device, utilization) - weights
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    if budget <= 0 or not per_token:
        lines.append(f"                the weights do not leave room for a cache on {name}")
    else:
        tokens = budget // per_token
        lines.append(
            f"                ~{tokens:,} tokens fit on {name} (utilization {utilization}, after "
            f"{weights / 2**30:.2f} GiB of weights): {tokens // mc.max_model_len} sequences of "
            f"max_model_len {mc.max_model_len}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    mc = ModelConfig(
        args.model,
        revision=args.revision,
        dtype=args.dtype,
        quantization=args.quantization,
        quantization_args=args.quantization_args,
    )
    _, arch = resolve_model_class(mc.architectures)
    with qdist.simulated_tp(1, 0):
        full = initialize_model(mc, "meta")
    stored = sum(p.numel() * p.element_size() for p in full.parameters())
    print(f"model:          {args.model}")
    print(f"architecture:   {arch}")
    print(f"dtype:          {str(mc.dtype).removeprefix('torch.')}")
    qc = mc.quant_config
    print(f"quantization:   {qc.get_name() if qc else 'none'}")
    print(
        f"parameters:     {_logical_params(full) / 1e6:.3f} M ({stored / 2**20:.2f} MiB as stored)"
    )
    print(f"context length: {mc.max_model_len}")
    print(f"shard plan (tp={args.tp}, rank 0):")
    rank_model, lines = shard_plan(mc, args.tp)
    for line in lines:
        print(line)
    for line in kv_cache_lines(rank_model, mc, args.gpu_memory_utilization):
        print(line)
    return 0
