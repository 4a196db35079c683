"""AsyncEngine: drives an `LLMEngine` from one background thread for asyncio callers.

Requests arrive through a thread-safe inbox and are added between steps (continuous batching);
each request's outputs go back to the caller's event loop through its own asyncio.Queue. An
error inside a step is fatal: every open request gets it, the traceback is printed, and the
process exits (under torchrun the other ranks are then torn down) instead of hanging.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass

from quantfw.engine.engine import LLMEngine
from quantfw.engine.sampling_params import SamplingParams
from quantfw.engine.sequence import RequestOutput


@dataclass
class _Pending:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


class RequestStream:
    """The outputs of one accepted request; abort it by leaving the iteration early."""

    def __init__(self, engine: AsyncEngine, pending: _Pending):
        self._engine = engine
        self._pending = pending
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._pending.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    self.finished = True
                    return
        finally:
            if not self.finished:
                self._engine.abort(self._pending.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, exit_on_error: bool = True):
        self.engine = engine
        self.exit_on_error = exit_on_error
        self._inbox: queue.Queue = queue.Queue()
        self._open: dict[str, _Pending] = {}
        self._wake = threading.Event()
        self._stop = False
        self._counter = 0
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="quantfw-engine", daemon=True)
        self._thread.start()

    async def add(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request; raises ValueError (bad prompt or params) before anything streams."""
        if self.dead is not None:
            raise RuntimeError(f"the engine has stopped after an error: {self.dead}")
        self._counter += 1
        rid = request_id or f"srv-{self._counter}"
        pending = _Pending(rid, prompt, params, asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", pending))
        self._wake.set()
        ack = await pending.out.get()
        if isinstance(ack, BaseException):
            raise ack
        return RequestStream(self, pending)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # -- engine thread ------------------------------------------------------------------------

    @staticmethod
    def _send(p: _Pending, item: object) -> None:
        p.loop.call_soon_threadsafe(p.out.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(arg.prompt, arg.params, arg.request_id)
                except ValueError as e:
                    self._send(arg, e)
                    continue
                self._open[arg.request_id] = arg
                self._send(arg, "accepted")
            elif kind == "abort" and self._open.pop(arg, None) is not None:
                self.engine.abort(arg)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    pending = self._open.get(out.request_id)
                    if pending is None:
                        continue
                    self._send(pending, out)
                    if out.finished:
                        del self._open[out.request_id]
        except BaseException as e:  # a failed step leaves the cache and the TP ranks unknown
            self.dead = e
            traceback.print_exc()
            for pending in self._open.values():
                self._send(pending, RuntimeError(f"engine step failed: {e}"))
            if self.exit_on_error:
                print("quantfw serve: engine failed, exiting", file=sys.stderr, flush=True)
                os._exit(1)
