"""The ``quantfw`` command. Each subcommand lives in its own module exposing
``add_parser(subparsers)`` (which sets ``func`` on its parser); heavy or optional imports
(transformers, fastapi) happen inside the subcommand's ``func``, so ``quantfw --help`` works
without the optional extras."""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand modules, in the order `--help` lists them
SUBCOMMANDS = (
    "quantfw.entrypoints.cmd_info",
    "quantfw.entrypoints.cmd_demo",
    "quantfw.entrypoints.cmd_quantize",
    "quantfw.entrypoints.cmd_generate",
    "quantfw.entrypoints.cmd_serve",
    "quantfw.entrypoints.cmd_tune_w4a16",
    "quantfw.entrypoints.cmd_bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantfw",
        description="Load dense and quantized HF checkpoints and run them with tensor parallelism.",
    )
    from quantfw import __version__

    parser.add_argument("--version", action="version", version=f"quantfw {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyError, OSError) as e:
        print(f"quantfw {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
