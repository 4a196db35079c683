"""``quantfw serve MODEL``: the OpenAI-compatible server (needs ``pip install quantfw[serve]``).

Under ``torchrun --nproc-per-node N -m quantfw.entrypoints.cli serve ...`` TP rank 0 runs the
HTTP server and the scheduler; the other ranks run the steps it broadcasts.
"""

from __future__ import annotations

import argparse
import sys

from quantfw.engine.cli_args import add_engine_args, engine_kwargs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="model id clients use")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from quantfw.entrypoints.openai_server import build_app
    except ImportError as e:
        raise OSError(
            f"quantfw serve needs the serve extra (pip install quantfw[serve]): {e}"
        ) from e
    from quantfw import distributed as qdist
    from quantfw.engine.async_engine import AsyncEngine
    from quantfw.engine.engine import LLMEngine

    engine = LLMEngine(args.model, **engine_kwargs(args))
    if not qdist.is_tp_leader():
        try:
            engine.runner.worker_loop()
        except Exception as e:
            print(
                f"quantfw serve: TP rank {qdist.get_tp_rank()} failed: {e}",
                file=sys.stderr,
                flush=True,
            )
            raise
        qdist.destroy_distributed()
        return 0
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, args.served_model_name or args.model, args.api_key)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.shutdown()
        qdist.destroy_distributed()
    return 0
