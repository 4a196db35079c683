"""The state of one sequence (one of a request's `n` completions) and of its request."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from quantfw.engine.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives at one step."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class Sequence:
    """Prompt plus generated tokens, its KV-cache block tables (one per cache group) and how
    many of its tokens the cache holds."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_tables: list[list[int]] = field(default_factory=list)
    #: times this sequence was preempted (its cache dropped, to be recomputed)
    num_preemptions: int = 0
    num_computed: int = 0
    finish_reason: str | None = None
    #: decoded output text (kept up to date when streaming or matching stop strings)
    text: str = ""
    #: how many characters of `text` have been handed out (streaming)
    emitted_chars: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    #: text added since the previous output of this request (for streaming)
    delta_text: str = ""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    #: set when this request failed on its own (its sequences end with finish_reason "error")
    error: str | None = None
