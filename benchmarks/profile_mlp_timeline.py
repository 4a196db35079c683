"""An MLP's kernels on the decode timeline under programmatic dependent launch: for each layer,
when gate_up, the separate activation (if any) and down start and end (torch.profiler's CUDA
kernel events), for a Qwen3-8B-shaped kbitK model (dummy weights, CUDA graphs, batch 1), next
to the decode rate measured outside the profiler. With PDL a kernel launches before the one it
depends on has finished, so its recorded duration includes its wait; the start times show which
launch overlapped which (benchmarks/kbit-lab-log.md §16).

Modes, each in a fresh engine (CUDA graphs are captured at build): ``committed`` (the library's
rule) and ``separate`` (the activation in its own kernel: `mma.SEPARATE_ACT_BITS` holds K).

    python benchmarks/profile_mlp_timeline.py --bits 5 --modes committed,separate,committed
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
import profile_decode  # noqa: E402


def mlp_timeline(events) -> list[dict[str, float]]:
    """Per MLP (an RMSNorm, then kbit gate_up, optionally SiLU-and-mul, then kbit down), in us:
    the kernels' durations, when down starts after its predecessor starts and ends, and the
    span from gate_up's start to down's end."""
    ev = sorted(events, key=lambda e: e.time_range.start)
    names = [e.name for e in ev]
    rows = []
    for i in range(1, len(ev) - 2):
        if not (re.search("rms_norm", names[i - 1]) and "kbit" in names[i]):
            continue
        act = ev[i + 1] if re.search("silu", names[i + 1]) else None
        j = i + 2 if act else i + 1
        if j >= len(ev) or "kbit" not in names[j]:
            continue  # qkv (followed by the q/k-norm), not gate_up
        gate_up, down = ev[i], ev[j]
        prev = act or gate_up

        def dur(e):
            return e.time_range.end - e.time_range.start

        rows.append({
            "gate_up": dur(gate_up),
            "activation": dur(act) if act else 0.0,
            "down": dur(down),
            "down_start_after_prev_start": down.time_range.start - prev.time_range.start,
            "down_start_after_prev_end": down.time_range.start - prev.time_range.end,
            "down_end_after_prev_end": down.time_range.end - prev.time_range.end,
            "span": down.time_range.end - gate_up.time_range.start,
        })  # fmt: skip
    return rows


def run_mode(root: str, bits: int, mode: str, layers: int, steps: int) -> None:
    from quantfw.engine import LLMEngine
    from quantfw.kernels.kbit.triton import mma

    committed = mma.SEPARATE_ACT_BITS
    mma.SEPARATE_ACT_BITS = (*committed, bits) if mode == "separate" else committed
    try:
        path = profile_decode.make_model_dir(root, layers, f"kbit{bits}-{mode}")
        engine = LLMEngine(
            path, dtype="float16", load_format="dummy", max_model_len=1024, max_num_seqs=4,
            tokenizer=None, decode_window=1, quantization="kbit",
            quantization_args={"bits": bits},
        )  # fmt: skip
        rates = [profile_decode.decode_rate(engine, 1, 128, 64) for _ in range(3)]
        print(f"{mode}: decode tok/s {[round(r, 1) for r in rates]}", flush=True)
        prof = profile_decode.profiled_decode(engine, 1, steps)
    finally:
        mma.SEPARATE_ACT_BITS = committed
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    rows = mlp_timeline(kernels)
    print(f"{mode}: {len(rows)} MLPs in {steps} steps (us, median / mean)", flush=True)
    for key in rows[0] if rows else ():
        values = [r[key] for r in rows]
        print(
            f"   {key:30s} {statistics.median(values):8.2f} {statistics.mean(values):8.2f}",
            flush=True,
        )
    del engine
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bits", type=int, default=5)
    ap.add_argument("--modes", default="committed,separate,committed,separate")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}, kbit{args.bits}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        for mode in args.modes.split(","):
            if mode not in ("committed", "separate"):
                raise SystemExit(f"unknown mode {mode!r}: committed or separate")
            run_mode(root, args.bits, mode, args.layers, args.steps)


if __name__ == "__main__":
    main()
