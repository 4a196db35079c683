"""AsyncEngine: drives an `LLMEngine` from one background thread for asyncio callers.

Requests arrive through a thread-safe inbox and join between steps (continuous batching); each
request's outputs go back to its caller's event loop through its own asyncio.Queue.

Admission is bounded: at most ``max_running + max_queued`` requests are open at once and
`add` raises `EngineOverloadedError` beyond that, before anything is queued. Faults are split
in two: a request that fails on its own (its sampling or detokenization raised) ends with
`RequestFailedError` while the others go on; a step that raises leaves the cache and the TP
ranks in an unknown state, so the engine is dead from then on: every open request gets
`EngineDeadError`, so do later ones, and ``on_dead`` is called (the server shuts down).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from quantfw.engine.engine import LLMEngine
from quantfw.engine.sampling_params import SamplingParams
from quantfw.engine.sequence import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine stopped after a failed step; no request can be served any more."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are open; the caller should retry later."""


class RequestFailedError(RuntimeError):
    """This request raised inside the engine; the engine and the other requests go on."""


@dataclass
class _Pending:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


#: put on a stream's queue when its consumer cancels it, so a waiting iteration ends at once
_CANCELLED = object()


class RequestStream:
    """The outputs of one accepted request, in order; leaving the iteration early (or `cancel`)
    aborts the request and frees its sequences and cache at once."""

    def __init__(self, engine: AsyncEngine, pending: _Pending):
        self._engine = engine
        self._pending = pending
        self.request_id = pending.request_id
        self.finished = False
        self.cancelled = False

    def cancel(self) -> None:
        """Abort the request (e.g. its client went away); a waiting iteration returns."""
        if self.finished or self.cancelled:
            return
        self.cancelled = True
        self._engine.abort(self.request_id)
        self._pending.out.put_nowait(_CANCELLED)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._pending.out.get()
                if item is _CANCELLED:
                    return
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                yield item
                if item.finished:
                    self.finished = True
                    return
        finally:
            self.cancel()


class AsyncEngine:
    """Runs `engine` in a daemon thread.

    ``max_running``: how many requests the engine runs at once (its ``max_num_seqs``);
    ``max_queued``: how many more may wait for a place; ``on_dead(error)`` is called from the
    engine thread once, when a step fails.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_running: int = 64,
        max_queued: int = 256,
        on_dead: Callable[[BaseException], None] | None = None,
    ):
        if max_running < 1 or max_queued < 0:
            raise ValueError(
                f"max_running={max_running} must be >= 1, max_queued={max_queued} >= 0"
            )
        self.engine = engine
        self.max_open = max_running + max_queued
        self.on_dead = on_dead
        self.dead: BaseException | None = None
        self._inbox: queue.Queue = queue.Queue()
        # a decode window ends early for what arrives while it runs (adds, aborts)
        engine.arrivals_waiting = lambda: not self._inbox.empty()
        self._open: dict[str, _Pending] = {}
        self._num_open = 0  # admitted and not yet finished, aborted or rejected
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="quantfw-engine", daemon=True)
        self._thread.start()

    @property
    def num_open(self) -> int:
        """Requests admitted and not yet finished, aborted or rejected."""
        return self._num_open

    async def add(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue one request; see `add_many`."""
        return (await self.add_many([(prompt, params)], [request_id] if request_id else None))[0]

    async def add_many(
        self,
        requests: list[tuple[str | list[int], SamplingParams]],
        request_ids: list[str] | None = None,
    ) -> list[RequestStream]:
        """Queue requests all or none: raises `EngineOverloadedError` when they do not all fit,
        `EngineDeadError` after a failed step, and the engine's ValueError (bad prompt or
        params) with the ones already queued aborted, before anything streams."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped after an error: {self.dead}")
        with self._lock:
            if self._num_open + len(requests) > self.max_open:
                raise EngineOverloadedError(
                    f"the server is at capacity ({self._num_open} requests open, at most "
                    f"{self.max_open}); retry later"
                )
            self._num_open += len(requests)
        loop = asyncio.get_running_loop()
        ids = request_ids or [f"srv-{next(self._ids)}" for _ in requests]
        pendings = [
            _Pending(rid, prompt, params, loop, asyncio.Queue())
            for rid, (prompt, params) in zip(ids, requests)
        ]
        for p in pendings:
            self._inbox.put(("add", p))
        self._wake.set()
        streams, error = [], None
        try:
            for p in pendings:
                ack = await p.out.get()
                if isinstance(ack, BaseException):
                    error = error or ack
                else:
                    streams.append(RequestStream(self, p))
        except asyncio.CancelledError:  # the caller went away while its requests were queued
            for p in pendings:
                self.abort(p.request_id)
            raise
        if error is not None:
            for s in streams:
                s.cancel()
            raise error
        return streams

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the engine thread and release the other TP ranks; False when that could not be
        done cleanly (dead engine, or a step still running after `timeout` seconds)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=timeout)
        if self.dead is not None or self._thread.is_alive():
            return False
        self.engine.shutdown()
        return True

    # -- engine thread ------------------------------------------------------------------------

    @staticmethod
    def _send(p: _Pending, item: object) -> None:
        # a closed event loop (RuntimeError) means nobody is listening any more
        with contextlib.suppress(RuntimeError):
            p.loop.call_soon_threadsafe(p.out.put_nowait, item)

    def _close(self, request_id: str) -> _Pending | None:
        pending = self._open.pop(request_id, None)
        if pending is not None:
            self._release(1)
        return pending

    def _release(self, n: int) -> None:
        with self._lock:
            self._num_open -= n

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if self.dead is not None:
                    self._release(1)
                    self._send(arg, EngineDeadError(f"the engine has stopped: {self.dead}"))
                    continue
                try:
                    self.engine.add_request(arg.prompt, arg.params, arg.request_id)
                except Exception as e:  # ValueError: a bad request; anything else: its own fault
                    self._release(1)
                    self._send(arg, e)
                    continue
                self._open[arg.request_id] = arg
                self._send(arg, "accepted")
            elif kind == "abort" and self._close(arg) is not None:
                self.engine.abort(arg)

    def _dispatch(self, out: RequestOutput) -> None:
        pending = self._open.get(out.request_id)
        if pending is None:
            return
        if out.error is not None:
            self._close(out.request_id)
            self._send(pending, RequestFailedError(out.error))
            return
        self._send(pending, out)
        if out.finished:
            self._close(out.request_id)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._dispatch(out)
        except BaseException as e:  # a failed step leaves the cache and the TP ranks unknown
            self._die(e)
            while not self._stop:  # keep rejecting adds that raced with the failure
                self._drain_inbox()
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _die(self, error: BaseException) -> None:
        self.dead = error
        traceback.print_exc()
        for rid in list(self._open):
            pending = self._close(rid)
            if pending is not None:
                self._send(pending, EngineDeadError(f"engine step failed: {error}"))
        if self.on_dead is not None:
            self.on_dead(error)
