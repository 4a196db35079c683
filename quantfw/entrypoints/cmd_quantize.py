"""``quantfw quantize``: export a dense checkpoint into a quantized on-disk format."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize",
        help="quantize a dense HF checkpoint into the AWQ (GEMM), GPTQ, kbit or MXFP4 format",
        description="Round-to-nearest quantization (no calibration) of the decoder's linear "
        "layers (kbit: nearest codebook level per element; MXFP4: and MoE experts, in GPT-OSS's "
        "format); embeddings, norms, routers and lm_head keep their dtype (kbit's "
        "--lm-head quantizes an untied lm_head too).",
    )
    p.add_argument("model", help="local folder or hub repo id of a dense checkpoint")
    from quantfw.exporter import EXPORT_METHODS

    p.add_argument("--method", required=True, choices=sorted(EXPORT_METHODS))
    p.add_argument("--out", required=True, help="output folder")
    # method options: only those given are passed on (each method has its own defaults and
    # rejects options it does not take)
    p.add_argument(
        "--bits", type=int, help="4 (AWQ, default); 2, 3, 4 or 8 (GPTQ, default 4); 2..5 (kbit)"
    )
    p.add_argument("--blocksize", type=int, help="kbit: elements per block (32, the default)")
    p.add_argument(
        "--lm-head",
        action="store_const",
        const=True,
        help="kbit: quantize the (untied) lm_head too; it keeps its dtype by default",
    )
    p.add_argument("--group-size", type=int, help="default 128; -1: one group per column")
    p.add_argument(
        "--desc-act",
        action="store_const",
        const=True,
        help="GPTQ act-order (seeded permutation)",
    )
    p.add_argument(
        "--sym",
        action=argparse.BooleanOptionalAction,
        help="GPTQ symmetric (zero = 2**(bits-1), the default); --no-sym for asymmetric",
    )
    p.add_argument(
        "--checkpoint-format",
        choices=["gptq", "gptq_v2"],
        help="GPTQ: 'gptq' (v1, stored zeros are z - 1; the default) or 'gptq_v2'",
    )
    p.add_argument("--seed", type=int, help="GPTQ: seed of the act-order permutations")
    p.add_argument(
        "--experts-only",
        action="store_const",
        const=True,
        help="MXFP4: quantize only MoE experts (GPT-OSS's released layout; attention stays dense)",
    )
    p.set_defaults(func=run)


#: CLI flag (argparse dest) -> exporter option
METHOD_OPTIONS = (
    "bits",
    "blocksize",
    "lm_head",
    "group_size",
    "desc_act",
    "sym",
    "checkpoint_format",
    "seed",
    "experts_only",
)


def run(args: argparse.Namespace) -> int:
    from quantfw.exporter import quantize_checkpoint

    options = {k: getattr(args, k) for k in METHOD_OPTIONS if getattr(args, k) is not None}
    out = quantize_checkpoint(args.model, args.out, method=args.method, **options)
    print(f"wrote {args.method} checkpoint to {out}")
    return 0
