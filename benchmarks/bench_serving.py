"""Serving under load, in process: a stream of requests with random prompt and answer lengths
arrives at a Poisson rate (or all at once) and `LLMEngine` serves them as `quantfw serve` does
(same defaults: CUDA graphs, decode windows that end early when requests arrive, prefill
graphs), on dummy weights. Per arm and
rate: time to first token and time per output token (mean, median, p99), output tokens/s and
requests/s, the engine's steps. An arm is one engine setting against the run's first, e.g.
``--arms "graphs:;eager-prefill:prefill_graph_tokens=0"``; arms alternate within each method
(A B B A ...) so that drift on the host hits both.

    python benchmarks/bench_serving.py qwen3-8b --methods fp16,kbit4 \\
        --arms "graphs:;eager-prefill:prefill_graph_tokens=0" --rates 4,inf \\
        --out benchmarks/results/serving/serving-qwen3-8b.json

TTFT counts from a request's scheduled arrival to the engine step that returns its first token
(queueing included); TPOT is the rest of its answer's time over its other tokens. The HTTP
layer is not in these figures (`bench_server_load.py` checks the server's behaviour).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """`num_requests` requests; prompt and answer lengths uniform in their inclusive ranges."""

    num_requests: int = 100
    prompt_len: tuple[int, int] = (32, 512)
    answer_len: tuple[int, int] = (32, 256)
    seed: int = 0

    def requests(self, vocab: int) -> list[tuple[list[int], int]]:
        """(prompt token ids, answer length) of every request, the same for every arm."""
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            n = rng.randint(*self.prompt_len)
            out.append(([rng.randrange(vocab) for _ in range(n)], rng.randint(*self.answer_len)))
        return out

    def arrivals(self, rate: float) -> list[float]:
        """Arrival times (s) of the requests at a Poisson `rate` (requests/s; inf: all at 0)."""
        if math.isinf(rate):
            return [0.0] * self.num_requests
        rng = random.Random(self.seed + 1)
        t, times = 0.0, []
        for _ in range(self.num_requests):
            t += rng.expovariate(rate)
            times.append(t)
        return times


def _triton_cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")


def triton_cache_entries() -> set[str]:
    """The entries of Triton's on-disk cache, one a compiled kernel; more after a run than
    before it means the run compiled some, which its tail latencies then include."""
    try:
        return set(os.listdir(_triton_cache_dir()))
    except OSError:
        return set()


def kernel_names(entries: set[str]) -> list[str]:
    """The kernels compiled into these cache entries (their metadata files' names)."""
    folder = _triton_cache_dir()
    names = []
    for entry in sorted(entries):
        try:
            files = os.listdir(os.path.join(folder, entry))
        except OSError:
            continue
        names += [f[:-5] for f in files if f.endswith(".json") and not f.startswith("__grp__")]
    return sorted(names)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _summary(values_s: list[float]) -> dict[str, float]:
    ms = [1e3 * v for v in values_s]
    return {
        "mean_ms": statistics.fmean(ms),
        "median_ms": statistics.median(ms),
        "p99_ms": _quantile(ms, 0.99),
    }


def serve(
    engine: Any,
    requests: list[tuple[list[int], int]],
    arrivals: list[float],
    window_yield: bool = True,
) -> dict:
    """Feed `requests` to `engine` at their `arrivals` and step it until all finish; the
    metrics of the run. Every request must produce exactly its answer length (ignore_eos).
    `window_yield`: a running decode window ends early for requests that arrived (as
    `AsyncEngine` asks it to)."""
    from quantfw.engine import SamplingParams

    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    ids: dict[str, int] = {}
    first: dict[int, float] = {}
    end: dict[int, float] = {}
    tokens: dict[int, int] = {}
    steps0, nxt = engine.stats.steps, 0
    start = time.perf_counter()

    def arrivals_waiting() -> bool:  # as `AsyncEngine`'s inbox tells a running decode window
        return nxt < len(order) and arrivals[order[nxt]] <= time.perf_counter() - start

    engine.arrivals_waiting = arrivals_waiting if window_yield else None
    compiled0 = triton_cache_entries()
    while nxt < len(order) or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            prompt, answer = requests[i]
            params = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True)
            ids[engine.add_request(prompt, params)] = i
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[order[nxt]] - now))
            continue
        outputs = engine.step()
        t = time.perf_counter() - start
        for o in outputs:
            i = ids[o.request_id]
            n = len(o.outputs[0].token_ids)
            if n and i not in first:
                first[i] = t
            if o.finished:
                end[i], tokens[i] = t, n
    duration = time.perf_counter() - start
    engine.arrivals_waiting = None
    wrong = [i for i, (_, answer) in enumerate(requests) if tokens.get(i) != answer]
    if wrong or len(first) != len(requests):
        raise RuntimeError(
            f"requests {wrong[:5]} did not produce their answer lengths, or "
            f"{len(requests) - len(first)} got no first token"
        )
    compiled = triton_cache_entries() - compiled0
    ttft = [first[i] - arrivals[i] for i in range(len(requests))]
    tpot = [(end[i] - first[i]) / (tokens[i] - 1) for i in range(len(requests)) if tokens[i] > 1]
    return {
        "duration_s": duration,
        "requests_per_s": len(requests) / duration,
        "output_tokens_per_s": sum(tokens.values()) / duration,
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": sum(tokens.values()),
        "engine_steps": engine.stats.steps - steps0,
        "kernels_compiled": kernel_names(compiled),
        "ttft": _summary(ttft),
        "tpot": _summary(tpot),
    }


def parse_arms(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``"name:key=value,key=value;name2:"`` -> [(name, LLMEngine kwargs)] (values as JSON,
    else strings); the key ``window_yield`` (default true) is `serve`'s, not the engine's."""
    arms = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, rest = part.partition(":")
        kwargs: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"arm {name!r}: {item!r} is not key=value")
            try:
                kwargs[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                kwargs[key.strip()] = value.strip()
        arms.append((name.strip(), kwargs))
    names = [a[0] for a in arms]
    if not arms or len(set(names)) != len(names) or not all(names):
        raise ValueError(f"--arms needs distinct, named arms: {spec!r}")
    return arms


def build_engine(folder: str, method: Any, args: argparse.Namespace, arm: dict[str, Any]):
    from quantfw.engine import LLMEngine

    gc.collect()
    kwargs = dict(
        dtype=args.dtype,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        tokenizer=None,
        **method.engine_kwargs(),
    )
    kwargs.update(arm)
    return LLMEngine(folder, **kwargs)


def markdown(result: dict) -> str:
    lines = [
        f"# Serving under load: {result['model']} on {result['device']} ({result['date']})",
        "",
        f"Commit {result['commit']}. {result['workload']['num_requests']} requests, prompts "
        f"{result['workload']['prompt_len']} tokens, answers {result['workload']['answer_len']} "
        f"(uniform), greedy; max_num_seqs {result['max_num_seqs']}, dtype {result['dtype']}.",
        "",
        "| method | arm | rate (req/s) | TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 "
        "(ms) | output tok/s | steps | kernels compiled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        m = run["metrics"]
        t, p = m["ttft"], m["tpot"]
        lines.append(
            f"| {run['method']} | {run['arm']} | {run['rate']} | {t['mean_ms']:.1f} / "
            f"{t['median_ms']:.1f} / {t['p99_ms']:.1f} | {p['mean_ms']:.2f} / {p['median_ms']:.2f}"
            f" / {p['p99_ms']:.2f} | {m['output_tokens_per_s']:.0f} | {m['engine_steps']} | "
            f"{len(m['kernels_compiled'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a bundled config (qwen3-8b, gpt-oss-20b...) or a config folder")
    p.add_argument("--methods", default="fp16")
    p.add_argument("--arms", default="default:", help="name:key=value,...;name2:... (see above)")
    p.add_argument("--rates", default="4,inf", help="requests/s, comma-separated (inf: a burst)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--prompt-len", default="32,512", help="min,max prompt tokens")
    p.add_argument("--answer-len", default="32,256", help="min,max answer tokens")
    p.add_argument("--repeats", type=int, default=1, help="runs of each arm and rate (A B B A)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (a .md beside it)")
    args = p.parse_args(argv)

    import torch

    from quantfw.bench.configs import read_hf_config, write_config_folder
    from quantfw.bench.measure import device_name, source_revision
    from quantfw.bench.methods import parse_methods

    def pair(text: str) -> tuple[int, int]:
        lo, hi = (int(x) for x in text.split(","))
        return lo, hi

    workload = Workload(args.num_requests, pair(args.prompt_len), pair(args.answer_len), args.seed)
    rates = [float(r) for r in args.rates.split(",")]
    arms = parse_arms(args.arms)
    config, label = read_hf_config(args.model)
    requests = workload.requests(config["vocab_size"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in parse_methods(args.methods):
            folder = write_config_folder(
                config, os.path.join(tmp, method.name), method.checkpoint_config_for(config)
            )
            for r in range(args.repeats):
                for name, arm in arms if r % 2 == 0 else arms[::-1]:
                    arm = dict(arm)
                    window_yield = bool(arm.pop("window_yield", True))
                    engine = build_engine(folder, method, args, arm)
                    # warm-up, the whole workload at once: compiles and autotunes the eager
                    # steps' shapes, which a first timed run would otherwise pay for
                    serve(engine, requests, [0.0] * len(requests))
                    for rate in rates:
                        metrics = serve(engine, requests, workload.arrivals(rate), window_yield)
                        runs.append(dict(method=method.name, arm=name, rate=rate, metrics=metrics))
                        t, o = metrics["ttft"], metrics["output_tokens_per_s"]
                        print(
                            f"{method.name:8s} {name:14s} rate {rate:>5}: TTFT p50 "
                            f"{t['median_ms']:.1f} ms p99 {t['p99_ms']:.1f} ms, TPOT p50 "
                            f"{metrics['tpot']['median_ms']:.2f} ms, {o:.0f} tok/s; compiled "
                            f"{metrics['kernels_compiled'] or 'nothing'}",
                            flush=True,
                        )
                    engine.shutdown()
                    del engine
    result = {
        "model": label,
        "device": device_name(device),
        "date": datetime.date.today().isoformat(),
        "commit": source_revision(),
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "workload": {
            "num_requests": workload.num_requests,
            "prompt_len": list(workload.prompt_len),
            "answer_len": list(workload.answer_len),
            "seed": workload.seed,
        },
        "arms": {name: arm for name, arm in arms},
        "argv": sys.argv[1:] if argv is None else argv,
        "runs": runs,
    }
    print(markdown(result))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
