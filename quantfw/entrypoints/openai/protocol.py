"""Request and response bodies of the OpenAI API (completions and chat), as pydantic models.

Requests forbid unknown fields: a field this server does not know is a 400 that names it, never
silently dropped. Fields of OpenAI's API that only make sense with features this server lacks
(tools, response formats, stored completions) are declared so their neutral values pass; any
other value is refused by the serving classes. Extensions beside OpenAI's fields use vLLM's
names: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
`include_stop_str_in_output`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

INT64 = 2**63


class APIError(Exception):
    """An error answered with OpenAI's error body and `status`."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(message: str, status: int, param: str | None = None, code: Any = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI (and vLLM) answer."""
    if status == 401:
        kind = "authentication_error"
    else:
        kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- requests ---------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """The fields completions and chat share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    #: the end user's id, for the operator's logs; it does not change the answer
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    #: a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: Any
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1, le=128)


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    #: a string or a list of content parts (only ``{"type": "text", "text": ...}`` is served)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # what clients send back from an assistant message: accepted when empty
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # accepted only with their neutral values (the serving class refuses the others)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None


# -- responses --------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Completions' shape: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A completion, and (with ``stream``) each chunk of one: the chunks have the same shape."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat's shape: one entry per token, each with its alternatives."""

    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        # a delta carries only what changed: {"role": ...} first, {"content": ...}, or {}
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


def sse(chunk: BaseModel, include_usage: bool) -> str:
    """One server-sent event. Chunks carry ``"usage"`` (null but on the last) only when the
    request asked for it with ``stream_options.include_usage``."""
    body = chunk.model_dump_json(exclude={"usage"} if not include_usage else None)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"
