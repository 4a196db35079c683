"""OpenAI-compatible HTTP server over an `AsyncEngine` (FastAPI; ``pip install quantfw[serve]``).

Routes: GET /health, GET /metrics (Prometheus text), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (``"stream": true`` answers with server-sent events). Errors use
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests
(bad fields, unknown model, prompt too long), 401 without the API key when one is set.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from quantfw.engine.async_engine import AsyncEngine, RequestStream
from quantfw.engine.llm import apply_chat_template
from quantfw.engine.sampling_params import SamplingParams
from quantfw.engine.sequence import CompletionOutput, RequestOutput

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    ignore_eos: bool = False

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            n=self.n,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=self.stop_token_ids or [],
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(message: str, status: int, param: str | None = None, code: Any = None) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Metrics:
    """Counters and a latency histogram, rendered in the Prometheus text format."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, status)] = self.requests.get((route, status), 0) + 1
        if route.startswith("/v1/") and route != "/v1/models":
            self.latency_sum += seconds
            self.latency_count += 1
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self.latency_buckets[i] += 1

    def render(self, engine: AsyncEngine) -> str:
        stats = engine.engine.stats
        lines = ["# TYPE quantfw_requests_total counter"]
        for (route, status), n in sorted(self.requests.items()):
            lines.append(f'quantfw_requests_total{{route="{route}",status="{status}"}} {n}')
        for name, value in (
            ("prompt_tokens_total", stats.prompt_tokens),
            ("generation_tokens_total", stats.generation_tokens),
            ("engine_steps_total", stats.steps),
            ("engine_requests_finished_total", stats.requests_finished),
        ):
            lines += [f"# TYPE quantfw_{name} counter", f"quantfw_{name} {value}"]
        sched = engine.engine.scheduler
        lines += [
            "# TYPE quantfw_num_requests_running gauge",
            f"quantfw_num_requests_running {len(sched.running)}",
            "# TYPE quantfw_num_requests_waiting gauge",
            f"quantfw_num_requests_waiting {len(sched.waiting)}",
            "# TYPE quantfw_request_latency_seconds histogram",
        ]
        for bound, n in zip(LATENCY_BUCKETS, self.latency_buckets):
            lines.append(f'quantfw_request_latency_seconds_bucket{{le="{bound}"}} {n}')
        lines += [
            f'quantfw_request_latency_seconds_bucket{{le="+Inf"}} {self.latency_count}',
            f"quantfw_request_latency_seconds_sum {self.latency_sum:.6f}",
            f"quantfw_request_latency_seconds_count {self.latency_count}",
        ]
        return "\n".join(lines) + "\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under the model id `model_name`."""
    app = FastAPI(title="quantfw", version="0.1.0")
    app.state.metrics = metrics = Metrics()
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len

    @app.middleware("http")
    async def auth_and_metrics(request: Request, call_next):
        start = time.perf_counter()
        path = request.url.path
        given = request.headers.get("authorization", "").encode()
        authorized = hmac.compare_digest(given, f"Bearer {api_key}".encode())
        if api_key and path.startswith("/v1/") and not authorized:
            response = JSONResponse(error_body("invalid or missing API key", 401), 401)
            metrics.observe(path, 401, time.perf_counter() - start)
            return response
        response = await call_next(request)
        metrics.observe(path, response.status_code, time.perf_counter() - start)
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        message = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
            for e in errors
        )
        return JSONResponse(error_body(message or "invalid request", 400, param), 400)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(str(exc), exc.status, exc.param, exc.code), exc.status)

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return JSONResponse({"status": "error", "detail": str(engine.dead)}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "quantfw"}
        card["max_model_len"] = max_model_len
        return {"object": "list", "data": [card]}

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                f"model {name!r} is not served here; available: {model_name!r}",
                param="model",
                code="model_not_found",
            )

    def default_max_tokens(prompt_len: int | None, requested: int | None) -> int:
        if requested is not None:
            return requested
        return 16 if prompt_len is None else max(1, max_model_len - prompt_len)

    async def submit(prompt: str | list[int], params: SamplingParams) -> RequestStream:
        try:
            return await engine.add(prompt, params)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from e

    def to_params(req: _Sampling, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise APIError(str(e)) from e

    def usage(outs: list[RequestOutput]) -> dict[str, int]:
        p = sum(len(o.prompt_token_ids) for o in outs)
        c = sum(len(x.token_ids) for o in outs for x in o.outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def token_str(token_id: int) -> str:
        return tokenizer.convert_ids_to_tokens(token_id) if tokenizer is not None else str(token_id)

    def completion_logprobs(comp: CompletionOutput) -> dict | None:
        if comp.logprobs is None:
            return None
        return {
            "tokens": [token_str(lp.token_id) for lp in comp.logprobs],
            "token_logprobs": [lp.logprob for lp in comp.logprobs],
            "top_logprobs": [{token_str(t): v for t, v in lp.top.items()} for lp in comp.logprobs],
            "text_offset": [],
        }

    def chat_logprobs(comp: CompletionOutput) -> dict | None:
        if comp.logprobs is None:
            return None
        content = []
        for lp in comp.logprobs:
            tok = token_str(lp.token_id)
            top = [{"token": token_str(t), "logprob": v, "bytes": None} for t, v in lp.top.items()]
            content.append(
                {"token": tok, "logprob": lp.logprob, "bytes": None, "top_logprobs": top}
            )
        return {"content": content}

    # -- /v1/completions ----------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        prompts: list[str | list[int]]
        if isinstance(req.prompt, str):
            prompts = [req.prompt]
        elif req.prompt and all(isinstance(t, int) for t in req.prompt):
            prompts = [req.prompt]  # type: ignore[list-item]
        else:
            prompts = list(req.prompt)  # type: ignore[arg-type]
        if not prompts:
            raise APIError("prompt must not be empty", param="prompt")
        params = to_params(req, default_max_tokens(None, req.max_tokens), req.logprobs)
        streams = [await submit(p, params) for p in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}

        if req.stream:

            async def events() -> AsyncIterator[str]:
                finals = []
                for i, stream in enumerate(streams):
                    async for out in stream:
                        for comp in out.outputs:
                            if comp.delta_text or comp.finish_reason:
                                choice = {
                                    "index": i * req.n + comp.index,
                                    "text": comp.delta_text,
                                    "logprobs": None,
                                    "finish_reason": comp.finish_reason,
                                }
                                yield _sse({**base, "choices": [choice]})
                        if out.finished:
                            finals.append(out)
                yield _sse({**base, "choices": [], "usage": usage(finals)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        finals = [await _last(s) for s in streams]
        choices = []
        for i, out in enumerate(finals):
            for comp in out.outputs:
                text = (out.prompt or "") + comp.text if req.echo else comp.text
                choices.append(
                    {
                        "index": i * req.n + comp.index,
                        "text": text,
                        "logprobs": completion_logprobs(comp),
                        "finish_reason": comp.finish_reason,
                    }
                )
        return {**base, "choices": choices, "usage": usage(finals)}

    # -- /v1/chat/completions -----------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        check_model(req.model)
        messages = [{"role": m.role, "content": _content_text(m.content)} for m in req.messages]
        try:
            prompt_ids = apply_chat_template(tokenizer, messages)
        except ValueError as e:
            raise APIError(str(e), param="messages") from e
        except Exception as e:  # a template that rejects these messages
            raise APIError(f"chat template failed on these messages: {e}", param="messages") from e
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = default_max_tokens(
            len(prompt_ids), req.max_completion_tokens or req.max_tokens
        )
        stream = await submit(prompt_ids, to_params(req, max_tokens, logprobs))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": model_name}

        if req.stream:

            async def events() -> AsyncIterator[str]:
                chunk = {**base, "object": "chat.completion.chunk"}
                for i in range(req.n):
                    delta = {"role": "assistant", "content": ""}
                    choice = {"index": i, "delta": delta, "finish_reason": None}
                    yield _sse({**chunk, "choices": [choice]})
                final = None
                async for out in stream:
                    for comp in out.outputs:
                        if comp.delta_text or comp.finish_reason:
                            choice = {
                                "index": comp.index,
                                "delta": {"content": comp.delta_text} if comp.delta_text else {},
                                "finish_reason": comp.finish_reason,
                            }
                            yield _sse({**chunk, "choices": [choice]})
                    final = out
                if final is not None:
                    yield _sse({**chunk, "choices": [], "usage": usage([final])})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        out = await _last(stream)
        choices = [
            {
                "index": comp.index,
                "message": {"role": "assistant", "content": comp.text},
                "logprobs": chat_logprobs(comp),
                "finish_reason": comp.finish_reason,
            }
            for comp in out.outputs
        ]
        return {**base, "object": "chat.completion", "choices": choices, "usage": usage([out])}

    return app


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None
    return last


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(
                f"message content part of type {part.get('type')!r} is not supported (text only)",
                param="messages",
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)
