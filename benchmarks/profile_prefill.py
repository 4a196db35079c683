"""Where a prefill's wall time goes: GPU kernels against the host, on one GPU or under torchrun.

A bundled config's model (dummy weights) prefills one ``--prompt-len`` prompt ``--repeats``
times (wall time of each, device synchronised), then once under torch.profiler on the TP
leader: the kernels' summed time and their busy time (the union of their intervals: NCCL
overlapping compute counts once), the wall time, the kernel launches, the top kernels and the
host's top ops by self time. Wall well above busy time means the host sets the pace (found at
TP = 2 on two H200s, 2026-11-26: `benchmarks/mxfp4-lab-log.md` §21).

    python benchmarks/profile_prefill.py gpt-oss-20b --methods fp16,mxfp4
    torchrun --nproc-per-node 2 benchmarks/profile_prefill.py gpt-oss-20b --methods fp16,mxfp4

With ``--python-profile N`` one more prefill runs under cProfile and its top N Python
functions are printed (by own time and with callees): where the host's time goes when wall
time is well above busy time (mxfp4-lab-log §30). Its engines are deleted before the process
group's teardown (a diag that kept one alive hung at exit on the GPUs); run it under `timeout`
there.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import statistics
import tempfile
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def kernel_times(prof) -> tuple[float, float, int, dict[str, float]]:
    """(summed us, busy us, launches, us by kernel name) of the profile's device kernels (user
    annotations left out: they repeat their kernels' time)."""
    spans, by_name = [], defaultdict(float)
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA or evt.is_user_annotation:
            continue
        start, end = evt.time_range.start, evt.time_range.end
        spans.append((start, end))
        by_name[re.sub(r"\s+", " ", evt.name)[:90]] += end - start
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return sum(e - s for s, e in spans), busy, len(spans), dict(by_name)


def timed_prefill(engine, prompt: list[int], sync) -> float:
    """Wall ms of one prompt's prefill (a request that stops at its first token)."""
    from quantfw.engine import SamplingParams

    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    sync()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    return (time.perf_counter() - start) * 1e3


def python_profile(engine, prompt: list[int], sync, top: int) -> None:
    """One more prefill under cProfile: the Python functions with the most own time, and
    those with the most time including their callees (launch wrappers, descriptors, plans)."""
    prof = cProfile.Profile()
    prof.enable()
    wall = timed_prefill(engine, prompt, sync)
    prof.disable()
    print(f"   python-profiled prefill {wall:.1f} ms wall")
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        lines = out.getvalue().splitlines()
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        print(f"   by {key}:")
        print("\n".join("   " + ln for ln in lines[start : start + top + 1]))


def report(
    engine, method: str, prompts: list[list[int]], on_gpu: bool, python_top: int = 0
) -> None:
    """The leader's measurements: every prompt but the last (or, with `python_top`, the last
    two) timed, the next profiled by torch.profiler, the last by cProfile."""
    from quantfw import distributed as qdist

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if python_top:
        prompts, extra = prompts[:-1], prompts[-1]
    walls = [timed_prefill(engine, p, sync) for p in prompts[:-1]]
    print(
        f"{method} tp={qdist.get_tp_size()}: prefill ms {[round(w, 1) for w in walls]}, "
        f"median of the last {len(walls) - 1}: {statistics.median(walls[1:]):.1f}"
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        wall = timed_prefill(engine, prompts[-1], sync)
    total, busy, launches, by_name = kernel_times(prof)
    print(
        f"{method}: profiled prefill {wall:.1f} ms wall, kernels {total / 1e3:.1f} ms summed / "
        f"{busy / 1e3:.1f} ms busy, {launches} launches"
    )
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
        print(f"   {us / 1e3:8.2f} ms  {name}")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"   host {e.self_cpu_time_total / 1e3:8.2f} ms x{e.count:5d}  {e.key[:70]}")
    if python_top:
        python_profile(engine, extra, sync, python_top)


def main() -> None:
    from quantfw import distributed as qdist
    from quantfw.bench.configs import read_hf_config, write_config_folder
    from quantfw.bench.measure import leader_session
    from quantfw.bench.methods import parse_methods
    from quantfw.engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", help="a bundled config, e.g. gpt-oss-20b or qwen3-8b")
    ap.add_argument(
        "--methods",
        default="fp16",
        help="names `quantfw bench --methods` takes: fp16, mxfp4, kbit4",
    )
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=6, help="timed prefills before the profiled")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--python-profile", type=int, default=0, metavar="N",
        help="one more prefill under cProfile: its top N Python functions",
    )  # fmt: skip
    args = ap.parse_args()
    qdist.init_distributed(qdist.world_size_from_env())
    on_gpu = torch.cuda.is_available()
    config, _ = read_hf_config(args.model)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, config["vocab_size"], (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.repeats + 1 + (args.python_profile > 0))
    ]
    rank = qdist.global_rank_from_env()
    with tempfile.TemporaryDirectory() as tmp:
        for method in parse_methods(args.methods):
            quant = method.checkpoint_config_for(config)
            folder = write_config_folder(config, os.path.join(tmp, f"{method.name}-{rank}"), quant)
            engine = LLMEngine(
                folder, dtype=args.dtype if on_gpu else "float32", load_format="dummy",
                max_model_len=args.max_model_len, max_num_seqs=16, tokenizer=None,
                **method.engine_kwargs(),
            )  # fmt: skip
            leader_session(
                engine,
                lambda e=engine, m=method.name: report(e, m, prompts, on_gpu, args.python_profile),
            )
            del engine
            if on_gpu:
                torch.cuda.empty_cache()
    qdist.destroy_distributed()


if __name__ == "__main__":
    main()
