"""``quantfw quantize``: round-to-nearest export of a dense checkpoint to AWQ or GPTQ."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize",
        help="RTN-quantize a dense HF checkpoint into the AWQ (GEMM) or GPTQ on-disk format",
        description="Round-to-nearest quantization (no calibration) of the decoder's linear "
        "layers; embeddings, norms and lm_head keep their dtype.",
    )
    p.add_argument("model", help="local folder or hub repo id of a dense checkpoint")
    p.add_argument("--method", required=True, choices=["awq", "gptq"])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--bits", type=int, default=4, help="4 (AWQ); 2, 3, 4 or 8 (GPTQ)")
    p.add_argument("--group-size", type=int, default=128, help="-1: one group per column")
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order (seeded permutation)")
    p.add_argument(
        "--sym",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GPTQ symmetric (zero = 2**(bits-1)); --no-sym for asymmetric",
    )
    p.add_argument(
        "--checkpoint-format",
        default="gptq",
        choices=["gptq", "gptq_v2"],
        help="GPTQ: 'gptq' (v1, stored zeros are z - 1) or 'gptq_v2'",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the act-order permutations")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quantfw.exporter import quantize_checkpoint

    out = quantize_checkpoint(
        args.model,
        args.out,
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        desc_act=args.desc_act,
        sym=args.sym,
        checkpoint_format=args.checkpoint_format,
        seed=args.seed,
    )
    print(f"wrote {args.method} checkpoint to {out}")
    return 0
