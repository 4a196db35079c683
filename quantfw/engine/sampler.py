"""Turns one step's logits into tokens, request by request.

Order: repetition/presence/frequency penalties and logit bias, then temperature, then top-k, top-p and min-p
filtering, then a draw from the request's own generator (greedy requests take the argmax).
Log-probabilities are those of the model's raw distribution (before penalties and filtering).
"""

from __future__ import annotations

import torch

from quantfw.engine.sampling_params import SamplingParams
from quantfw.engine.sequence import Sequence, TokenLogprob


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """Penalised (and logit-biased) copy of one row of logits [V]."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
        if seen.numel():
            vals = logits[seen]
            p = params.repetition_penalty
            logits = logits.clone()
            logits[seen] = torch.where(vals > 0, vals / p, vals * p)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(
            torch.tensor(output_ids, device=logits.device), minlength=logits.shape[-1]
        )[: logits.shape[-1]].to(logits.dtype)
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
        logits = logits.index_add(0, ids, bias.to(logits.dtype))
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature plus top-k / top-p / min-p on one row [V]; removed tokens get -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    params = seq.params
    logits = apply_penalties(logits, params, seq.prompt_token_ids, seq.output_token_ids)
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = filter_logits(logits, params).softmax(-1)
    # draw on the CPU with the request's generator: reproducible on any device and batch
    return int(torch.multinomial(probs.cpu(), 1, generator=seq.generator).item())


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits or asks for log-probabilities."""
    return (
        params.greedy
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and not params.logit_bias
    )


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
    """One token (and its log-probabilities when asked) per row of logits [B, V].

    Plain greedy rows take one batched argmax (one device-to-host copy per step); the others
    go row by row."""
    logits = logits.float()
    plain = [i for i, seq in enumerate(seqs) if plain_greedy(seq.params)]
    fast: dict[int, int] = {}
    if plain:
        rows = logits if len(plain) == len(seqs) else logits[plain]
        fast = dict(zip(plain, rows.argmax(-1).tolist()))
    results: list[tuple[int, TokenLogprob | None]] = []
    for i, (row, seq) in enumerate(zip(logits, seqs)):
        if i in fast:
            results.append((fast[i], None))
            continue
        token = sample_one(row, seq)
        lp = None
        if seq.params.logprobs is not None:
            logp = torch.log_softmax(row, -1)
            top: dict[int, float] = {}
            if seq.params.logprobs > 0:
                vals, ids = torch.topk(logp, seq.params.logprobs)
                top = {int(i): float(v) for i, v in zip(ids.tolist(), vals.tolist())}
            lp = TokenLogprob(token, float(logp[token].item()), top)
        results.append((token, lp))
    return results
