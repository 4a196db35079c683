"""A `quantfw bench` run's report: comparisons with fp16, the printed tables, JSON and a chart."""

from __future__ import annotations

import json
import os
import re
from typing import Any

BASELINE = "fp16"


def add_comparisons(methods: dict[str, dict[str, Any]]) -> None:
    """Give every measured method ``vs_fp16`` ratios (speeds: >1 is faster than fp16; sizes: >1
    is larger) when fp16 was measured in the same run."""
    base = methods.get(BASELINE)
    if not base or base.get("status") != "ok":
        return
    for m in methods.values():
        if m.get("status") != "ok":
            continue
        ratios: dict[str, Any] = {
            "prefill_speed": base["prefill_ms"] / m["prefill_ms"],
            "ttft_speed": base["ttft_ms"] / m["ttft_ms"],
            "weight": m["weight_gib"] / base["weight_gib"],
            "decode_speed": {
                b: run["tokens_per_s"] / base["decode"][b]["tokens_per_s"]
                for b, run in m["decode"].items()
                if b in base["decode"]
            },
        }
        if m.get("peak_excl_kv_cache_gib") and base.get("peak_excl_kv_cache_gib"):
            ratios["peak_excl_kv_cache"] = (
                m["peak_excl_kv_cache_gib"] / base["peak_excl_kv_cache_gib"]
            )
        m["vs_fp16"] = ratios


def _fmt(value: float | None, spec: str, ratio: float | None = None) -> str:
    if value is None:
        return "-"
    text = format(value, spec)
    return f"{text} ({ratio:.2f}x)" if ratio is not None else text


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def format_report(report: dict[str, Any]) -> str:
    """The printed summary: one table of load/memory/prefill, one of decode per batch size."""
    s = report["settings"]
    head = (
        f"quantfw bench: {report['model']} on {report['device']} (tp={report['tensor_parallel_size']}"
        f"), {s['dtype']}, {report['date']}\n"
        f"prefill: one {s['prompt_len']}-token prompt (median of {s['prefill_repeats']}); decode: "
        f"{s['decode_tokens']} steps after {s['decode_context']}-token prompts; max_model_len "
        f"{s['max_model_len']}\n"
    )
    if report.get("copy_bandwidth_gb_s"):
        head += (
            f"copy bandwidth {report['copy_bandwidth_gb_s']:.0f} GB/s; decode floor = batch x "
            "bandwidth / weight bytes read per step (per rank; of a MoE layer's experts, the\n"
            "expected share a batch routes to with uniform routing)\n"
        )
    head += (
        "(x) is the ratio to fp16 in this run: speed for times and tokens/s, size for GiB; build s "
        "is the engine's construction (dummy weights, repack, KV cache, CUDA graphs)\n"
    )
    batch_sizes = [str(b) for b in s["batch_sizes"]]
    summary, decode, notes = [], [], []
    for name, m in report["methods"].items():
        if m["status"] != "ok":
            notes.append(f"{name}: {m['status']}: {m['reason']}")
            continue
        vs = m.get("vs_fp16", {})
        summary.append(
            [
                name,
                _fmt(m["build_s"], ".1f"),
                _fmt(m["weight_gib"], ".3g", vs.get("weight")),
                _fmt(m["peak_gib"], ".3g"),
                _fmt(m["peak_excl_kv_cache_gib"], ".3g", vs.get("peak_excl_kv_cache")),
                _fmt(m["prefill_ms"], ".1f", vs.get("prefill_speed")),
                _fmt(m["ttft_ms"], ".1f", vs.get("ttft_speed")),
            ]
        )
        row = [name]
        for b in batch_sizes:
            run = m["decode"][b]
            cell = _fmt(run["tokens_per_s"], ".1f", vs.get("decode_speed", {}).get(b))
            if "floor_tokens_per_s" in run:
                percent = 100 * run["floor_fraction"]
                shown = f"{percent:.0f}" if percent >= 10 else f"{percent:.2g}"
                cell += f" [{shown}% of {run['floor_tokens_per_s']:.0f}]"
            row.append(cell)
        decode.append(row)
    out = [head]
    if summary:
        out.append(
            _table(
                [
                    "method",
                    "build s",
                    "weights GiB",
                    "peak GiB",
                    "peak excl. KV GiB",
                    "prefill ms",
                    "TTFT ms",
                ],
                summary,
            )
        )
        out.append(
            "\n"
            + _table(
                ["decode tok/s", *(f"batch {b} [% of floor]" for b in batch_sizes)],
                decode,
            )
        )
    for name, m in report["methods"].items():
        if m.get("quantization_config"):  # what the model was built with, kept modules included
            config = json.dumps(m["quantization_config"], sort_keys=True)
            notes.append(f"{name}: quantization_config {config}")
        if m.get("uncounted_weight_layers"):
            notes.append(
                f"{name}: WARNING: {m['uncounted_weight_layers']} quantized layers keep their "
                "weights outside parameters and buffers: weights GiB and the floor miss them"
            )
    out += notes
    return "\n".join(out) + "\n"


def format_markdown(report: dict[str, Any], text: str, chart: str | None) -> str:
    """The run as Markdown (what docs/benchmarks.md shows): device, date, command, tables."""
    lines = [
        f"# quantfw bench: {report['model']} on {report['device']}",
        "",
        f"- date: {report['date']}",
        f"- device: {report['device']} (tensor parallel size {report['tensor_parallel_size']})",
        f"- torch: {report['torch']}",
        f"- quantfw: {report.get('quantfw', '?')} (source {report.get('source') or 'not a git checkout'})",
        f"- command: `{report['command']}`",
        "",
        "```text",
        text.rstrip(),
        "```",
    ]
    if chart:
        lines += ["", f"![decode and prefill]({chart})"]
    return "\n".join(lines) + "\n"


def result_stem(report: dict[str, Any]) -> str:
    """``bench-<model>-<device>-tp<N>-<date>``, safe as a file name."""
    raw = f"bench-{report['model']}-{report['device']}-tp{report['tensor_parallel_size']}"
    return re.sub(r"[^A-Za-z0-9.-]+", "_", raw).strip("_") + f"-{report['date']}"


def write_json(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def write_chart(report: dict[str, Any], path: str) -> str | None:
    """A PNG of decode tokens/s per batch size (with the floors) and prefill time per method;
    returns why not when matplotlib is missing (``pip install quantfw[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'quantfw[bench]'): no chart written"
    measured = {n: m for n, m in report["methods"].items() if m["status"] == "ok"}
    if not measured:
        return "no method was measured: no chart written"
    batch_sizes = [str(b) for b in report["settings"]["batch_sizes"]]
    fig, axes = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [max(2, len(batch_sizes)), 1.4]}
    )
    width = 0.8 / len(measured)
    for i, (name, m) in enumerate(measured.items()):
        xs = [j + i * width for j in range(len(batch_sizes))]
        speeds = [m["decode"][b]["tokens_per_s"] for b in batch_sizes]
        axes[0].bar(xs, speeds, width, label=name)
        floors = [m["decode"][b].get("floor_tokens_per_s") for b in batch_sizes]
        if all(f is not None for f in floors):
            axes[0].scatter(xs, floors, marker="_", s=300, color="black", zorder=3)
    shown = [
        v
        for m in measured.values()
        for run in m["decode"].values()
        for v in (run["tokens_per_s"], run.get("floor_tokens_per_s"))
        if v
    ]
    if max(shown) > 20 * min(shown):
        axes[0].set_yscale("log")
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(batch_sizes))])
    axes[0].set_xticklabels([f"batch {b}" for b in batch_sizes])
    axes[0].set_ylabel("decode tokens/s (black: bandwidth floor)")
    axes[0].legend()
    axes[1].bar(list(measured), [m["prefill_ms"] for m in measured.values()], color="gray")
    axes[1].set_ylabel(f"prefill ms, {report['settings']['prompt_len']}-token prompt")
    fig.suptitle(
        f"{report['model']} on {report['device']} (tp={report['tensor_parallel_size']}, "
        f"{report['settings']['dtype']}), {report['date']}"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
