"""``quantfw serve MODEL``: the OpenAI-compatible server (needs ``pip install quantfw[serve]``).

Under ``torchrun --nproc-per-node N -m quantfw.entrypoints.cli serve ...`` TP rank 0 runs the
HTTP server and the scheduler; the other ranks run the steps it broadcasts. A rank that dies
ends the job within seconds: torchrun stops the others (rank 0 shuts down on its SIGTERM within
`SHUTDOWN_GRACE_S` + `TEARDOWN_LIMIT_S`), and a step that fails on rank 0 (a peer's connection
closed) kills the engine, which stops the server and exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from quantfw.engine.cli_args import add_engine_args, engine_kwargs

#: seconds open connections get to finish when the server stops (then they are closed)
SHUTDOWN_GRACE_S = 5
#: seconds stopping the engine and the TP group may take before the process exits regardless
#: (a blocked collective with a dead peer)
TEARDOWN_LIMIT_S = 10


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="model id clients use")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests that may wait beyond the --max-num-seqs running ones; more get a 503",
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from quantfw.entrypoints.openai.api_server import build_app
    except ImportError as e:
        raise OSError(
            f"quantfw serve needs the serve extra (pip install quantfw[serve]): {e}"
        ) from e
    from quantfw import distributed as qdist
    from quantfw.engine.async_engine import AsyncEngine
    from quantfw.engine.engine import LLMEngine

    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests={args.max_queued_requests} must be >= 0")
    engine = LLMEngine(args.model, **engine_kwargs(args))
    if not qdist.is_tp_leader():
        return _run_worker(engine)

    server: uvicorn.Server | None = None

    def on_dead(error: BaseException) -> None:
        print(
            f"quantfw serve: the engine failed ({type(error).__name__}: {error}); shutting down",
            file=sys.stderr,
            flush=True,
        )
        if server is not None:
            server.should_exit = True

    async_engine = AsyncEngine(
        engine,
        max_running=args.max_num_seqs,
        max_queued=args.max_queued_requests,
        on_dead=on_dead,
    )
    app = build_app(async_engine, args.served_model_name or args.model, api_key=args.api_key)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = uvicorn.Server(config)
    # uvicorn stops gracefully on SIGINT/SIGTERM, then raises the signal again: make SIGTERM an
    # exception too, so the engine and the TP ranks are released below
    signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        server.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        _teardown(async_engine, qdist)
    return 1 if async_engine.dead is not None else 0


def _raise_system_exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _run_worker(engine) -> int:
    from quantfw import distributed as qdist

    try:
        engine.runner.worker_loop()
    except KeyboardInterrupt:
        # Ctrl-C on torchrun reaches every rank; the leader shuts the server down and says so
        return 130
    except Exception as e:
        print(
            f"quantfw serve: TP rank {qdist.get_tp_rank()} failed: {e}", file=sys.stderr, flush=True
        )
        raise
    qdist.destroy_distributed()
    return 0


def _teardown(async_engine, qdist) -> None:
    """Stop the engine and release the TP ranks, or exit the process if that blocks."""

    def give_up() -> None:
        print(
            f"quantfw serve: shutdown blocked for {TEARDOWN_LIMIT_S} s (a TP rank gone?); exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    watchdog = threading.Timer(TEARDOWN_LIMIT_S, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        clean = async_engine.shutdown(timeout=TEARDOWN_LIMIT_S)
    except Exception as e:  # releasing the other ranks failed: one of them is gone
        print(f"quantfw serve: stopping the TP ranks failed: {e}", file=sys.stderr, flush=True)
        clean = False
    if not clean and qdist.get_tp_size() > 1:
        # the other ranks may be blocked in a collective with us: leave at once, torchrun
        # (or their broken connections) ends them
        print("quantfw serve: the engine stopped uncleanly; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    qdist.destroy_distributed()
    watchdog.cancel()
