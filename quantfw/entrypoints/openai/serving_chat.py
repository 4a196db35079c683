"""``POST /v1/chat/completions``: messages through the tokenizer's chat template, `n`,
chat-shaped logprobs, streamed (role first, then content deltas) or not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from quantfw.engine.async_engine import RequestStream
from quantfw.engine.llm import apply_chat_template
from quantfw.engine.sequence import TokenLogprob
from quantfw.entrypoints.openai.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    sse,
)
from quantfw.entrypoints.openai.serving import EventStream, OpenAIServing

#: message fields of tool calling and audio; accepted only empty (clients send them back)
_UNSUPPORTED_MESSAGE_FIELDS = (
    "tool_calls",
    "tool_call_id",
    "function_call",
    "audio",
    "refusal",
    "annotations",
)


class OpenAIServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        """The response, or with ``stream`` the server-sent events to send."""
        self.check_common(req)
        self._check_unsupported(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        messages = [self._message(i, m) for i, m in enumerate(req.messages)]
        try:
            prompt_ids = apply_chat_template(self.llm.tokenizer, messages)
        except ValueError as e:
            raise APIError(str(e), param="messages") from e
        except Exception as e:  # a template that rejects these messages
            raise APIError(f"chat template failed on these messages: {e}", param="messages") from e
        requested, param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        max_tokens = self.max_tokens(
            len(prompt_ids), requested, prompt_param="messages", param=param
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, n=req.n, logprobs=logprobs)
        streams = await self.submit([(prompt_ids, params)])
        rid, created = self.new_id("chatcmpl")
        if req.stream:
            return self.event_stream(
                self._events(req, rid, created, len(prompt_ids), streams), streams
            )
        (out,) = await self.finals(streams)
        choices = [
            ChatChoice(
                index=comp.index,
                message=ChatResponseMessage(content=comp.text),
                logprobs=self._logprobs(comp.token_ids, 0, comp.logprobs or [])
                if req.logprobs
                else None,
                finish_reason=comp.finish_reason,
            )
            for comp in out.outputs
        ]
        generated = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(
            id=rid,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=self.usage([len(prompt_ids)], generated),
        )

    async def _events(
        self,
        req: ChatCompletionRequest,
        rid: str,
        created: int,
        prompt_len: int,
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice], usage=None) -> str:
            body = ChatCompletionChunk(
                id=rid, created=created, model=self.model_name, choices=choices, usage=usage
            )
            return sse(body, req.include_usage)

        for j in range(req.n):
            role = DeltaMessage(role="assistant", content="")
            yield chunk([ChatStreamChoice(index=j, delta=role)])
        tokens: dict[int, int] = {}
        async for u in self.updates(streams, req.n, req.logprobs):
            tokens[u.index] = len(u.token_ids)
            choice = ChatStreamChoice(
                index=u.index,
                delta=DeltaMessage(content=u.text or None),
                logprobs=self._logprobs(u.token_ids, u.start, u.logprobs) if req.logprobs else None,
                finish_reason=u.finish_reason,
            )
            yield chunk([choice])
        if req.include_usage:
            yield chunk([], self.usage([prompt_len], sum(tokens.values())))

    @staticmethod
    def _check_unsupported(req: ChatCompletionRequest) -> None:
        if req.response_format not in (None, {"type": "text"}):
            raise APIError(
                "response_format other than {'type': 'text'} is not supported",
                param="response_format",
            )
        if req.tools:
            raise APIError("tools (function calling) are not supported", param="tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools, which are not supported", param="tool_choice")
        if req.store:
            raise APIError("stored completions (store=true) are not supported", param="store")

    @staticmethod
    def _message(i: int, m: ChatMessage) -> dict[str, Any]:
        for name in _UNSUPPORTED_MESSAGE_FIELDS:
            if getattr(m, name):
                raise APIError(
                    f"messages[{i}].{name} is not supported (no tools or audio)",
                    param=f"messages[{i}].{name}",
                )
        if isinstance(m.content, list):
            parts = []
            for k, part in enumerate(m.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        f"messages[{i}].content[{k}] of type {part.get('type')!r} is not "
                        "supported (text parts only)",
                        param=f"messages[{i}].content[{k}]",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        else:
            content = m.content or ""
        message = {"role": m.role, "content": content}
        if m.name:
            message["name"] = m.name
        return message

    def _logprobs(
        self, token_ids: Sequence[int], start: int, logprobs: list[TokenLogprob]
    ) -> ChatLogprobs:
        """Chat's logprobs of token_ids[start:]: each token with its `top_logprobs` best
        alternatives."""
        content = []
        for k, lp in enumerate(logprobs):
            before = token_ids[: start + k]
            top = []
            for t, v in lp.top.items():
                text = self.token_text(before, t)
                top.append(ChatTopLogprob(token=text, logprob=v, bytes=list(text.encode())))
            text = self.token_text(before, lp.token_id)
            content.append(
                ChatTokenLogprob(
                    token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)
