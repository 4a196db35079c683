"""The FastAPI app: routes, OpenAI-shaped errors, the API key, metrics, client disconnects.

Routes: GET /health (503 once the engine is dead), GET /metrics, GET /v1/models,
POST /v1/completions, POST /v1/chat/completions. Errors answer
``{"error": {"message", "type", "param", "code"}}``: 400 for an invalid request (the field named
in ``param``), 401 without the API key when one is set, 404 for an unknown model or route,
500 for a request that failed inside the engine, 503 when the server is full or its engine dead.
A client that disconnects has its requests aborted at once, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import time
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quantfw import __version__
from quantfw.engine.async_engine import AsyncEngine
from quantfw.entrypoints.openai.metrics import ServerMetrics
from quantfw.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from quantfw.entrypoints.openai.serving import EventStream
from quantfw.entrypoints.openai.serving_chat import OpenAIServingChat
from quantfw.entrypoints.openai.serving_completions import OpenAIServingCompletion

ROUTES = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}
#: status answered to a client that went away before its response (nobody reads it)
CLIENT_CLOSED_REQUEST = 499


def build_app(engine: AsyncEngine, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The app serving `engine` under the model id `model_name`."""
    app = FastAPI(title="quantfw", version=__version__)
    completions = OpenAIServingCompletion(engine, model_name)
    chat = OpenAIServingChat(engine, model_name)
    metrics = ServerMetrics(engine, ROUTES)
    app.add_middleware(_AuthAndMetrics, api_key=api_key, metrics=metrics)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return JSONResponse({"status": "error", "detail": str(engine.dead)}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "quantfw"}
        card["max_model_len"] = engine.engine.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, completions.create(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, chat.create(body))

    return app


async def _respond(request: Request, work: Awaitable[BaseModel | EventStream]) -> Response:
    """Run `work` until it is done or the client disconnects (then it is cancelled, which
    aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, APIError):
                await task
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    result = task.result()  # an APIError goes to its handler
    if isinstance(result, EventStream):
        return _EventStreamResponse(result)
    return JSONResponse(result.model_dump(mode="json"))


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStreamResponse(StreamingResponse):
    """Server-sent events; however the response ends (done, client gone, never started), the
    engine requests behind it are aborted if still running."""

    def __init__(self, stream: EventStream):
        super().__init__(
            stream.events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.cancel()


class _AuthAndMetrics:
    """ASGI middleware: the bearer key on /v1 routes, and each request's status and time to
    its last byte (streams included)."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path = scope["path"]
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.expected and path.startswith("/v1/") and not self._authorized(scope):
                response = JSONResponse(error_body("invalid or missing API key", 401), 401)
                await response(scope, receive, send_and_record)
                return
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.observe(path, status, time.perf_counter() - start)

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected or b"")


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|.*[\[\]-].*)$")


def _param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"`` (pydantic's union-member
    tags such as ``list[str]`` dropped)."""
    out = ""
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.match(part):
            out += f".{part}" if out else part
    return out or None


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        body = error_body(str(exc), exc.status, exc.param, exc.code)
        return JSONResponse(body, exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        messages, param, depth = [], None, -1
        for e in exc.errors():
            if e.get("type") == "json_invalid":
                messages.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', '')}")
                continue
            loc = tuple(e.get("loc", ()))
            if len(loc) > depth:  # the most specific place (a union reports each member)
                param, depth = _param(loc), len(loc)
            msg = e.get("msg", "invalid")
            if e.get("type") == "extra_forbidden":
                msg = "unknown or unsupported field"
            elif e.get("type") == "missing":
                msg = "missing required field"
            messages.append(f"{_param(loc) or 'body'}: {msg}")
        return JSONResponse(error_body("; ".join(messages), 400, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", 500), 500)
