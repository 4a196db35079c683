"""``quantfw demo``: build a tiny random model from a bundled HF config with transformers, save
it, load it back through quantfw and check the logits against transformers'."""

from __future__ import annotations

import argparse
import json
import tempfile
from importlib import resources

import torch

DEMO_CONFIGS = ("tiny_llama",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="round-trip a tiny bundled model through quantfw and check it against transformers",
    )
    p.add_argument("--config", default="tiny_llama", choices=DEMO_CONFIGS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-4, help="max relative error of logits")
    p.set_defaults(func=run)


def bundled_config(name: str) -> dict:
    text = resources.files("quantfw.data").joinpath(name, "config.json").read_text()
    return json.loads(text)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return (
        (ours.double() - reference.double()).abs().max() / reference.double().abs().max()
    ).item()


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    import quantfw

    raw = bundled_config(args.config)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(args.seed)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory(prefix="quantfw-demo-") as folder:
        reference.save_pretrained(folder)
        print(
            f"saved a random {config.architectures[0]} ({sum(p.numel() for p in reference.parameters()) / 1e6:.2f} M params) to {folder}"
        )
        model = quantfw.load_model(folder, device="cpu")
        input_ids = torch.randint(0, config.vocab_size, (2, 32))
        with torch.no_grad():
            expected = reference(input_ids).logits
            got = model(input_ids)
    err = relative_error(got, expected)
    ok = got.shape == expected.shape and err <= args.tolerance
    print(
        f"logits {tuple(got.shape)}: max relative error vs transformers {err:.2e} "
        f"(tolerance {args.tolerance:.0e}) -> {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1
