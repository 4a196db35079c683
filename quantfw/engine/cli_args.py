"""Command-line options shared by ``quantfw generate`` and ``quantfw serve``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from quantfw.layers.attention.selector import BACKENDS


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (``'{"bits": 4}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a JSON object; write the options as '{{\"bits\": 4}}'"
        )
    return value


def add_quantization_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default=None, help="force a quantization method")
    p.add_argument(
        "--quantization-args",
        type=json_object,
        default=None,
        help="the method's options as a JSON object, merged over the checkpoint's "
        """quantization_config: --quantization kbit --quantization-args '{"bits": 4}'""",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="HF repo id or local folder")
    add_quantization_args(p)
    p.add_argument("--dtype", default="auto", help="auto, float16, bfloat16 or float32")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS)
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode eagerly on the GPU")
    p.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=None,
        help="steps that prefill, of up to N tokens, replay CUDA graphs (default 512, at most "
        "--max-num-batched-tokens and --max-model-len; 0: eager)",
    )
    p.add_argument("--load-format", default="auto")
    p.add_argument("--revision", default=None)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        quantization=args.quantization,
        quantization_args=args.quantization_args,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        cuda_graphs=False if args.no_cuda_graphs else None,
        prefill_graph_tokens=args.prefill_graph_tokens,
        load_format=args.load_format,
        revision=args.revision,
    )
