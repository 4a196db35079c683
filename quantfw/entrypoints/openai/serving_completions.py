"""``POST /v1/completions``: one prompt or a batch (strings or token ids), `n` and `best_of`,
`echo`, completions-shaped logprobs, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from quantfw.engine.async_engine import RequestStream
from quantfw.engine.sequence import CompletionOutput, TokenLogprob
from quantfw.entrypoints.openai.protocol import (
    APIError,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    sse,
)
from quantfw.entrypoints.openai.serving import EventStream, OpenAIServing


@dataclass
class _Prompt:
    ids: list[int]
    text: str | None  # as given; None for token ids


def _is_token_ids(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest) -> CompletionResponse | EventStream:
        """The response, or with ``stream`` the server-sent events to send."""
        self.check_common(req)
        if req.suffix:
            raise APIError("suffix (text insertion) is not supported", param="suffix")
        best_of = req.best_of or req.n
        if best_of < req.n:
            raise APIError(f"best_of={best_of} must be >= n={req.n}", param="best_of")
        if req.stream and best_of > req.n:
            raise APIError("best_of > n cannot be streamed", param="best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(
                "echo with logprobs needs the prompt's logprobs, which this server does not "
                "compute; drop echo or logprobs",
                param="echo",
            )
        prompts = self._prompts(req.prompt)
        # best_of ranks completions by their mean token logprob: ask for it when it is needed
        logprobs = req.logprobs if best_of == req.n else req.logprobs or 0
        requests = []
        for p in prompts:
            max_tokens = self.max_tokens(
                len(p.ids), req.max_tokens, prompt_param="prompt", param="max_tokens"
            )
            requests.append(
                (p.ids, self.sampling_params(req, max_tokens, n=best_of, logprobs=logprobs))
            )
        streams = await self.submit(requests)
        rid, created = self.new_id("cmpl")
        if req.stream:
            return self.event_stream(self._events(req, rid, created, prompts, streams), streams)
        finals = await self.finals(streams)
        choices, generated = [], 0
        for i, (p, out) in enumerate(zip(prompts, finals)):
            comps = out.outputs
            if best_of > req.n:
                comps = sorted(comps, key=_mean_logprob, reverse=True)[: req.n]
            for j, comp in enumerate(comps):
                echo = self._echo_text(p) if req.echo else ""
                lp = None
                if req.logprobs is not None:
                    lp = self._logprobs(comp.token_ids, 0, comp.logprobs or [], len(echo))
                choices.append(
                    CompletionChoice(
                        index=i * req.n + j,
                        text=echo + comp.text,
                        logprobs=lp,
                        finish_reason=comp.finish_reason,
                    )
                )
                generated += len(comp.token_ids)
        return CompletionResponse(
            id=rid,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=self.usage([len(p.ids) for p in prompts], generated),
        )

    async def _events(
        self,
        req: CompletionRequest,
        rid: str,
        created: int,
        prompts: list[_Prompt],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], usage=None) -> str:
            body = CompletionResponse(
                id=rid, created=created, model=self.model_name, choices=choices, usage=usage
            )
            return sse(body, req.include_usage)

        offsets: dict[int, int] = {}  # text offset of each choice's next token (logprobs)
        if req.echo:
            for i, p in enumerate(prompts):
                for j in range(req.n):
                    text = self._echo_text(p)
                    offsets[i * req.n + j] = len(text)
                    yield chunk([CompletionChoice(index=i * req.n + j, text=text)])
        tokens: dict[int, int] = {}
        async for u in self.updates(streams, req.n, req.logprobs is not None):
            lp = None
            if req.logprobs is not None:
                lp = self._logprobs(u.token_ids, u.start, u.logprobs, offsets.get(u.index, 0))
                if lp.tokens:
                    offsets[u.index] = lp.text_offset[-1] + len(lp.tokens[-1])
            tokens[u.index] = len(u.token_ids)
            choice = CompletionChoice(
                index=u.index, text=u.text, logprobs=lp, finish_reason=u.finish_reason
            )
            yield chunk([choice])
        if req.include_usage:
            yield chunk([], self.usage([len(p.ids) for p in prompts], sum(tokens.values())))

    def _prompts(self, prompt: object) -> list[_Prompt]:
        if isinstance(prompt, str) or _is_token_ids(prompt):
            items = [prompt]
        elif (
            isinstance(prompt, list)
            and prompt
            and (all(isinstance(x, str) for x in prompt) or all(map(_is_token_ids, prompt)))
        ):
            items = prompt
        else:
            raise APIError(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists, none of them empty",
                param="prompt",
            )
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(_Prompt(self.encode(item, "prompt"), item))
            else:
                out.append(_Prompt(list(item), None))
        return out

    def _echo_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.llm.decode(p.ids)

    def _logprobs(
        self, token_ids: Sequence[int], start: int, logprobs: list[TokenLogprob], offset: int
    ) -> CompletionLogprobs:
        """Completions' logprobs of token_ids[start:]; each token's alternatives include the
        token itself (as vLLM answers: up to ``logprobs + 1`` entries)."""
        out = CompletionLogprobs()
        for k, lp in enumerate(logprobs):
            before = token_ids[: start + k]
            text = self.token_text(before, lp.token_id)
            top = {self.token_text(before, t): v for t, v in lp.top.items()}
            top.setdefault(text, lp.logprob)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out


def _mean_logprob(comp: CompletionOutput) -> float:
    lps = comp.logprobs or []
    return sum(lp.logprob for lp in lps) / max(len(lps), 1)
