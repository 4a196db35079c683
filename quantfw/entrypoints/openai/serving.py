"""What the completions and chat serving classes share: request checks, prompt lengths against
the context, sampling parameters, admission into the engine, per-choice stream updates, token
texts for logprobs and usage."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from quantfw.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from quantfw.engine.sampling_params import SamplingParams
from quantfw.engine.sequence import RequestOutput, TokenLogprob
from quantfw.entrypoints.openai.protocol import (
    SSE_DONE,
    APIError,
    SamplingRequest,
    UsageInfo,
    error_body,
)

#: how many preceding output tokens give a token its text (spaces, merges) in logprobs
TOKEN_TEXT_CONTEXT = 6


@dataclass
class ChoiceUpdate:
    """What one choice gained since its previous update."""

    index: int  # the choice's index in the response
    text: str  # text added (held back while it could still become a stop string)
    token_ids: list[int]  # all output tokens so far
    start: int  # index in `token_ids` of the first token not reported before
    logprobs: list[TokenLogprob]  # those of token_ids[start:], when asked for
    finish_reason: str | None


@dataclass
class EventStream:
    """The server-sent events of a streamed response and the engine requests behind them."""

    events: AsyncIterator[str]
    streams: list[RequestStream]

    def cancel(self) -> None:
        """Abort the requests still running (the client is gone)."""
        for s in self.streams:
            s.cancel()


class OpenAIServing:
    """Base of the serving classes of one route each."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.llm = engine.engine
        self.model_name = model_name
        self.max_model_len = self.llm.max_model_len

    @staticmethod
    def new_id(prefix: str) -> tuple[str, int]:
        return f"{prefix}-{uuid.uuid4().hex}", int(time.time())

    # -- checks -------------------------------------------------------------------------------

    def check_common(self, req: SamplingRequest) -> None:
        if req.model != self.model_name:
            raise APIError(
                f"model {req.model!r} is not served here; available: {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        if req.stream_options is not None and not req.stream:
            raise APIError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )

    def encode(self, text: str, param: str) -> list[int]:
        try:
            return self.llm.encode(text)
        except ValueError as e:  # no tokenizer
            raise APIError(str(e), param=param) from e

    def max_tokens(
        self, prompt_len: int, requested: int | None, *, prompt_param: str, param: str
    ) -> int:
        """`requested` (the field `param`), checked to fit the context with the prompt (the
        field `prompt_param`); absent: the rest of the context."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {prompt_len}, which leaves no room for a completion",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return room
        if requested > room:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens; you asked "
                f"for {prompt_len + requested} ({prompt_len} in the prompt, {requested} in the "
                f"completion): reduce the prompt or {param}",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    @staticmethod
    def logit_bias(req: SamplingRequest) -> dict[int, float]:
        """The bias by token id (values and the vocabulary are checked by the engine)."""
        bias: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(
                    f"logit_bias key {key!r} is not a token id", param="logit_bias"
                ) from None
        return bias

    def sampling_params(
        self, req: SamplingRequest, max_tokens: int, *, n: int, logprobs: int | None
    ) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                n=n,
                stop=stop,
                stop_token_ids=req.stop_token_ids or [],
                seed=req.seed,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=logprobs,
                logit_bias=self.logit_bias(req),
            )
        except ValueError as e:  # "SamplingParams.<field>=<value> must ..."
            field = re.match(r"SamplingParams\.(\w+)=", str(e))
            raise APIError(str(e), param=field.group(1) if field else None) from e

    # -- running ------------------------------------------------------------------------------

    async def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestStream]:
        """Admit all requests or none (503 when the server is full or its engine dead)."""
        if len(requests) > self.engine.max_open:
            raise APIError(
                f"{len(requests)} prompts in one request; this server takes at most "
                f"{self.engine.max_open} at once",
                param="prompt",
            )
        try:
            return await self.engine.add_many(requests)
        except EngineOverloadedError as e:
            raise APIError(str(e), status=503, code="server_overloaded") from e
        except EngineDeadError as e:
            raise APIError(str(e), status=503, code="engine_dead") from e
        except ValueError as e:  # the engine's checks: empty prompt, ids outside the vocabulary
            param = "logit_bias" if str(e).startswith("logit_bias") else "prompt"
            raise APIError(str(e), param=param) from e

    @staticmethod
    def failure(error: Exception) -> APIError:
        """The 500 of a request that failed inside the engine."""
        return APIError(f"the request failed in the engine: {error}", status=500)

    async def finals(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """The last output of each stream, in order; a failure inside the engine is a 500."""
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in _merge(streams):
                last[i] = out
        except (RequestFailedError, EngineDeadError) as e:
            raise self.failure(e) from e
        return [last[i] for i in range(len(streams))]

    async def updates(
        self, streams: list[RequestStream], n: int, logprobs: bool
    ) -> AsyncIterator[ChoiceUpdate]:
        """Per-choice updates of the streams (choice index ``stream * n + completion``): only
        those that carry text, new logprobs or the finish reason, which comes exactly once."""
        reported: dict[int, int] = {}
        done: set[int] = set()
        async for i, out in _merge(streams):
            for comp in out.outputs:
                index = i * n + comp.index
                if index in done:
                    continue
                start = reported.get(index, 0)
                new_logprobs = (comp.logprobs or [])[start:] if logprobs else []
                if not comp.delta_text and not new_logprobs and comp.finish_reason is None:
                    continue
                reported[index] = len(comp.token_ids)
                if comp.finish_reason is not None:
                    done.add(index)
                yield ChoiceUpdate(
                    index, comp.delta_text, comp.token_ids, start, new_logprobs, comp.finish_reason
                )

    def event_stream(self, events: AsyncIterator[str], streams: list[RequestStream]) -> EventStream:
        return EventStream(self._guard(events, streams), streams)

    async def _guard(
        self, events: AsyncIterator[str], streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        """`events`, then ``[DONE]``; a failure after the headers went out becomes an error
        event (the openai client raises it); the requests are aborted if the client leaves."""
        try:
            async for event in events:
                yield event
        except (RequestFailedError, EngineDeadError) as e:
            err = self.failure(e)
            yield _error_event(err)
        except APIError as e:
            yield _error_event(e)
        except Exception as e:  # a defect here: still tell the client rather than cut it off
            yield _error_event(APIError(f"{type(e).__name__}: {e}", status=500))
        finally:
            for s in streams:
                s.cancel()
        yield SSE_DONE

    # -- rendering ----------------------------------------------------------------------------

    def token_text(self, before: Sequence[int], token: int) -> str:
        """The text `token` adds after the output tokens `before` (so a choice's token texts
        concatenate to its text); ``token_id:N`` without a tokenizer."""
        if self.llm.tokenizer is None:
            return f"token_id:{token}"
        context = list(before[-TOKEN_TEXT_CONTEXT:])
        prefix = self.llm.decode(context) if context else ""
        text = self.llm.decode([*context, token])
        return text[len(prefix) :] if text.startswith(prefix) else self.llm.decode([token])

    @staticmethod
    def usage(prompt_lens: list[int], completion_tokens: int) -> UsageInfo:
        p = sum(prompt_lens)
        return UsageInfo(
            prompt_tokens=p, completion_tokens=completion_tokens, total_tokens=p + completion_tokens
        )


def _error_event(e: APIError) -> str:
    return f"data: {json.dumps(error_body(str(e), e.status, e.param, e.code))}\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position; the first
    error ends it, and leaving early cancels every stream."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].cancel()
        return
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                inbox.put_nowait((i, out))
            inbox.put_nowait((i, None))
        except Exception as e:
            inbox.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await inbox.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.cancel()
