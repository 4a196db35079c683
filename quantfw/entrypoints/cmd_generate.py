"""``quantfw generate MODEL --prompt ...``: complete prompts and print them, with tokens/s.

Under ``torchrun --nproc-per-node N -m quantfw.entrypoints.cli generate ...`` every rank runs
its shard and TP rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from quantfw.engine.cli_args import add_engine_args, engine_kwargs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate completions for prompts")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quantfw import distributed as qdist
    from quantfw.engine import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    if qdist.is_tp_leader():
        tokens = 0
        for out in outputs:
            comp = out.outputs[0]
            tokens += len(comp.token_ids)
            if args.json:
                record = {"prompt": out.prompt, "text": comp.text, "token_ids": comp.token_ids}
                record["finish_reason"] = comp.finish_reason
                print(json.dumps(record))
            else:
                print(f"{out.prompt}{comp.text}" if not args.chat else comp.text)
        print(
            f"{tokens} tokens in {elapsed:.2f}s ({tokens / max(elapsed, 1e-9):.1f} tokens/s)",
            file=sys.stderr,
        )
    qdist.destroy_distributed()
    return 0
