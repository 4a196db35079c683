"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling and stopping.

    ``temperature == 0`` is greedy. Penalties follow the usual conventions: `repetition_penalty`
    (transformers style, > 1 discourages any token seen in prompt or output), `presence_penalty`
    and `frequency_penalty` (OpenAI style, on output tokens only). `seed` makes a request
    reproducible on its own, whatever else is batched with it; with ``n > 1`` completion i uses
    ``seed + i``. `logprobs` asks for the sampled token's log-probability plus that many top
    alternatives per step (0: the sampled token's only). `logit_bias` adds a value in
    [-100, 100] to the logits of the given token ids before sampling (OpenAI's field).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()}
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (off) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("n", self.n >= 1, "must be >= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "logit_bias",
                all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items()),
                "must map token ids >= 0 to biases in [-100, 100]",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
