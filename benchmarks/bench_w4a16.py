"""W4A16 benchmark: fp16 cuBLAS vs torch tinygemm vs quantfw's Triton kernels vs the floor.

One run measures, on the GPU at hand:
  * the floor's two ceilings: device-to-device copy bandwidth (bytes read + written) and the
    bf16 matmul rate (8192^3 on random data);
  * for Qwen3-8B and Llama-3-70B TP=8 shard shapes and M in {1, 4, 16, 64, 256, 1024, 4096}:
    fp16 cuBLAS (F.linear), torch tinygemm (_weight_int4pack_mm, bf16), ours (fp16, AWQ layout,
    group 128), and floor = max(int4 bytes / copy bandwidth, flops / bf16 rate).
Each method is timed as CUDA-graph replays of many calls that rotate over enough weight copies
that L2 cannot hold them (launch overhead excluded for every method alike); the methods of a
row are replayed in turn over 5 rounds, order rotated each round, each after 20 ms of idle GPU
(what ran just before otherwise shifts a time by up to 10%), median of all replays.
Our configs are tuned per (M bucket, shape) first (warm-up), then timed; next to them, the
config a call gets without tuning (this GPU's shipped table, and the heuristic default), and a
kernel that only reads the int4 weight.  ``--configs-out DIR`` writes the tuned configs as
this GPU's table (quantfw/kernels/w4a16/tables.py).

Writes <out>/w4a16-<gpu>-<date>.json, .md and .png.  Not a test: run on a GPU machine, e.g.
``python benchmarks/bench_w4a16.py --out benchmarks/results``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from quantfw.kernels import w4a16 as W  # noqa: E402
from quantfw.kernels.common.timing import (  # noqa: E402
    events_median,
    graph_time,
    graph_times,
    n_copies,
)
from quantfw.kernels.w4a16 import tables as T  # noqa: E402
from quantfw.kernels.w4a16.configs import default_config  # noqa: E402
from quantfw.kernels.w4a16.triton import dispatch as TK  # noqa: E402
from quantfw.kernels.w4a16.triton.tuning import (  # noqa: E402
    packed_bytes,
    random_awq,
    rotated_timer,
)

SHAPES = [  # name, K (in), N (out)
    ("qwen3-8b.qkv", 4096, 6144),
    ("qwen3-8b.o", 4096, 4096),
    ("qwen3-8b.gate_up", 4096, 24576),
    ("qwen3-8b.down", 12288, 4096),
    ("llama3-70b-tp8.qkv", 8192, 1280),
    ("llama3-70b-tp8.o", 1024, 8192),
    ("llama3-70b-tp8.gate_up", 8192, 7168),
    ("llama3-70b-tp8.down", 3584, 8192),
]
MS = [1, 4, 16, 64, 256, 1024, 4096]
G = 128


def measure_ceilings():
    n = 1 << 29  # 1 GiB of bf16... 512 Mi elements * 2 B
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_()
    b = torch.empty_like(a)
    t_us = events_median(lambda: b.copy_(a), iters=10)
    copy_bw = 2 * a.numel() * 2 / (t_us * 1e-6)
    a = b = None
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_us = events_median(lambda: x @ y, iters=10)
    mm_rate = 2 * 8192**3 / (t_us * 1e-6)
    x = y = None
    torch.cuda.empty_cache()
    return copy_bw, mm_rate


@triton.jit
def _read_only(p, sink, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(p + i, mask=i < n, other=0)
    tl.atomic_add(sink + tl.program_id(0) % 64, tl.sum(v, 0))


def plain_read_us(nbytes, copies, est_us):
    """A kernel that only reads ``nbytes`` (8 warps x 16 KB per CTA, one atomic per CTA),
    timed like the matmuls: what reading the int4 weight alone costs at small M."""
    sink = torch.zeros(64, device="cuda", dtype=torch.int32)
    bufs = [torch.randint(0, 100, (nbytes // 4,), device="cuda", dtype=torch.int32)]
    bufs += [torch.randint_like(bufs[0], 0, 100) for _ in range(copies - 1)]
    n = bufs[0].numel()
    grid = (triton.cdiv(n, 4096),)
    return graph_time(
        [lambda b=b: _read_only[grid](b, sink, n, BLOCK=4096, num_warps=8) for b in bufs], est_us
    )


def bench_shape(name, K, N, ms, copy_bw, mm_rate, l2, log):
    dev = "cuda"
    rows = []
    int4_bytes = packed_bytes(K, N, G)
    packs = [random_awq(K, N, G, dev) for _ in range(n_copies(int4_bytes, l2))]
    fp16_ws = [
        torch.randn(N, K, device=dev, dtype=torch.float16) * 0.02
        for _ in range(n_copies(K * N * 2, l2))
    ]
    tg = []
    try:
        for _ in range(n_copies(int4_bytes, l2)):
            wu8 = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=dev)
            wp = torch.ops.aten._convert_weight_to_int4pack(wu8, 8)
            sz = torch.rand(K // G, N, 2, device=dev, dtype=torch.bfloat16)
            tg.append((wp, sz))
    except Exception as e:  # tinygemm not available in this torch build
        log(f"  tinygemm unavailable: {e!r:.200}")
        tg = []
    # correctness of ours on this shape (fresh random data, fp32 dequantized reference)
    wref = W.dequantize_packed(packs[0], torch.float32)
    for m in (1, 16, 256):
        x = torch.randn(m, K, device=dev, dtype=torch.float16)
        err = ((W.w4a16_matmul(x, packs[0]).float() - x.float() @ wref).norm()).item() / (
            (x.float() @ wref).norm().item()
        )
        log(f"  {name} M={m} rel err vs fp32 reference: {err:.2e}")
        rows.append({"shape": name, "check_M": m, "rel_err_fp16": err})
    del wref
    read_us = plain_read_us(int4_bytes, len(packs), int4_bytes / copy_bw * 1e6)
    log(f"  {name} read-only kernel over the {int4_bytes / 1e6:.2f} MB weight: {read_us:.2f} us")
    device_name = torch.cuda.get_device_name()
    for M in ms:
        x = torch.randn(M, K, device=dev, dtype=torch.float16)
        xb = x.to(torch.bfloat16)
        bytes_min = int4_bytes + M * K * 2 + M * N * 2
        floor_us = max(bytes_min / copy_bw, 2 * M * N * K / mm_rate) * 1e6
        timer = rotated_timer(x, packs, floor_us)
        t0 = time.time()
        cfg = TK.tune(x, packs[0], bench=timer)
        tune_s = time.time() - t0
        # what a call gets without tune(): the shipped table's entry, else the heuristic
        shipped_cfg = T.find_config(device_name, M, N, K, G)
        heuristic_cfg = default_config(M, N, K, G, TK._is_hopper(x))

        def ours_with(cfg, x=x, packs=packs):
            return [lambda p=p: TK.w4a16_matmul_cuda(x, p, config=cfg) for p in packs]

        methods = {
            "fp16": [lambda w=w, x=x: F.linear(x, w) for w in fp16_ws],
            "ours": [lambda p=p, x=x: W.w4a16_matmul(x, p) for p in packs],
            "heuristic": ours_with(heuristic_cfg),
        }
        if shipped_cfg is not None:
            methods["shipped"] = ours_with(shipped_cfg)
        if tg:
            try:
                torch.ops.aten._weight_int4pack_mm(xb, tg[0][0], G, tg[0][1])
                methods["tiny"] = [
                    lambda wp=wp, sz=sz, xb=xb: torch.ops.aten._weight_int4pack_mm(xb, wp, G, sz)
                    for wp, sz in tg
                ]
            except Exception as e:
                log(f"  tinygemm failed at M={M}: {e!r:.200}")
        # all methods of a row timed in interleaved rounds (see graph_times)
        t = dict(zip(methods, graph_times(list(methods.values()), floor_us)))
        fp16, ours, heuristic = t["fp16"], t["ours"], t["heuristic"]
        shipped, tiny = t.get("shipped"), t.get("tiny")
        row = {
            "shape": name,
            "K": K,
            "N": N,
            "M": M,
            "group_size": G,
            "fp16_cublas_us": fp16,
            "tinygemm_bf16_us": tiny,
            "ours_fp16_us": ours,
            "floor_us": floor_us,
            "plain_read_us": read_us,
            "ours_over_floor": ours / floor_us,
            "ours_over_fp16": ours / fp16,
            "fp16_over_ours": fp16 / ours,
            "config": list(cfg) if cfg else None,
            "tune_s": tune_s,
            "shipped_config": list(shipped_cfg) if shipped_cfg else None,
            "ours_shipped_us": shipped,
            "heuristic_config": list(heuristic_cfg),
            "ours_heuristic_us": heuristic,
        }
        rows.append(row)
        tiny_s = f"{tiny:9.1f}" if tiny else "      n/a"
        shipped_s = f"{shipped:7.1f}" if shipped else "    n/a"
        log(
            f"  {name:24s} M={M:5d} fp16 {fp16:9.1f}  tinygemm {tiny_s}  ours {ours:9.1f}"
            f"  floor {floor_us:8.1f}  ours/floor {ours / floor_us:5.2f}  ours/fp16 "
            f"{ours / fp16:5.2f}  cfg {cfg}  shipped {shipped_s}  heuristic {heuristic:7.1f}"
            f" {heuristic_cfg}"
        )
    del packs, fp16_ws, tg
    torch.cuda.empty_cache()
    return rows


def bf16_extra(log):
    """Ours with bf16 activations next to fp16 (gate_up shape): time and error."""
    out = []
    K, N = 4096, 24576
    packs_by_dtype = {
        dtype: [random_awq(K, N, G, "cuda", dtype) for _ in range(3)]
        for dtype in (torch.float16, torch.bfloat16)
    }
    for M in (1, 16, 1024):
        res = {}
        for dtype, packs in packs_by_dtype.items():
            wref = W.dequantize_packed(packs[0], torch.float32)
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            ref = x.float() @ wref
            err = ((W.w4a16_matmul(x, packs[0]).float() - ref).norm() / ref.norm()).item()
            t = graph_time([lambda p=p, x=x: W.w4a16_matmul(x, p) for p in packs], 10.0)
            res[str(dtype).split(".")[-1]] = {"us": t, "rel_err": err}
        log(
            f"  gate_up M={M}: "
            + ", ".join(f"{k} {v['us']:.1f} us err {v['rel_err']:.1e}" for k, v in res.items())
        )
        out.append({"M": M, **res})
    return out


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarize(rows):
    perf = [r for r in rows if "M" in r]
    qwen = [r for r in perf if r["shape"].startswith("qwen3")]
    lines = []
    small = [r for r in qwen if r["M"] in (1, 16)]
    ok_small = [r for r in small if r["ours_over_floor"] <= 1.33]
    lines.append(
        f"M in (1, 16), Qwen3-8B: {len(ok_small)}/{len(small)} within 1.33x floor; worst "
        f"{max(r['ours_over_floor'] for r in small):.2f}x"
    )
    lines.append(
        "M in (1, 16), Qwen3-8B, a kernel that only reads the int4 weight: "
        + ", ".join(
            f"{r['shape'].split('.')[-1]} {r['plain_read_us'] / r['floor_us']:.2f}x floor"
            for r in small
            if r["M"] == 1
        )
        + f"; ours / that read {min(r['ours_fp16_us'] / r['plain_read_us'] for r in small):.2f}x"
        f"..{max(r['ours_fp16_us'] / r['plain_read_us'] for r in small):.2f}x"
    )
    big = [r for r in perf if r["M"] >= 1024]
    ok_big = [r for r in big if r["ours_over_fp16"] <= 1.15]
    lines.append(
        f"M >= 1024: {len(ok_big)}/{len(big)} within 1.15x fp16; worst "
        f"{max((r['ours_over_fp16'] for r in big), default=float('nan')):.2f}x"
    )
    bad = [
        r
        for r in perf
        if r["ours_fp16_us"] > r["fp16_cublas_us"]
        and r["tinygemm_bf16_us"] is not None
        and r["ours_fp16_us"] > r["tinygemm_bf16_us"]
    ]
    lines.append(f"shapes slower than both fp16 and tinygemm: {len(bad)}")
    for key, what in (
        ("ours_shipped_us", "the shipped config table (no tune() call)"),
        ("ours_heuristic_us", "the heuristic default (shapes no table lists)"),
    ):
        ratios = [r[key] / r["ours_fp16_us"] for r in perf if r.get(key)]
        if ratios:
            lines.append(
                f"{what} / tuned in this run: geomean {_geomean(ratios):.2f}x, worst "
                f"{max(ratios):.2f}x over {len(ratios)} rows"
            )
    return lines


def write_outputs(out_dir, meta, rows, extra, summary):
    os.makedirs(out_dir, exist_ok=True)
    gpu = meta["gpu"].replace(" ", "_").replace("/", "_")
    base = os.path.join(out_dir, f"w4a16-{gpu}-{meta['date']}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "bf16": extra, "summary": summary}, f, indent=1)
    perf = [r for r in rows if "M" in r]
    with open(base + ".md", "w") as f:
        f.write(f"# W4A16 on {meta['gpu']} ({meta['date']})\n\n")
        f.write(
            f"copy bandwidth {meta['copy_bw_GBps']:.0f} GB/s, bf16 matmul "
            f"{meta['bf16_tflops']:.0f} TFLOP/s, group size {G}, times in us (CUDA-graph "
            "replays, weights rotated past L2)\n\n"
        )
        f.write(
            "| shape | M | fp16 cuBLAS | tinygemm (bf16) | ours (fp16) | floor | ours/floor "
            "| ours/fp16 | read-only kernel | shipped table | heuristic |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n"
        )
        for r in perf:
            cells = [
                f"{r[k]:.1f}" if r.get(k) else "n/a"
                for k in ("tinygemm_bf16_us", "plain_read_us", "ours_shipped_us")
            ]
            f.write(
                f"| {r['shape']} | {r['M']} | {r['fp16_cublas_us']:.1f} | {cells[0]} | "
                f"{r['ours_fp16_us']:.1f} | {r['floor_us']:.1f} | {r['ours_over_floor']:.2f} | "
                f"{r['ours_over_fp16']:.2f} | {cells[1]} | {cells[2]} | "
                f"{r['ours_heuristic_us']:.1f} |\n"
            )
        f.write(
            "\nours: the config tune() picked in this run; read-only kernel: one that only reads "
            "the int4 weight's bytes (no math), timed alike; shipped table / heuristic: ours "
            "with the config a call gets without tune() (this GPU's table in "
            "quantfw/kernels/w4a16/tuned, as it was before this run; else `default_config`).\n"
        )
        f.write("\n" + "\n".join(f"- {s}" for s in summary) + "\n")
    curves = {}
    for name in dict.fromkeys(r["shape"] for r in perf):
        rs = [r for r in perf if r["shape"] == name]
        curves[name] = (
            [r["M"] for r in rs],
            [r["ours_over_floor"] for r in rs],
            [r["ours_over_fp16"] for r in rs],
        )
    panels = (("ours / floor", [(1.33, "--")]), ("ours / fp16 cuBLAS", [(1.15, "--"), (1.0, ":")]))
    plot_panels(base + ".png", f"W4A16 on {meta['gpu']} {meta['date']}", curves, panels)
    return base


def log(s):
    print(s, flush=True)


def gpu_meta(log=log):
    """(meta, copy bandwidth B/s, bf16 matmul FLOP/s, L2 bytes) of GPU 0, ceilings measured
    now (seeds torch first)."""
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "date": dt.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sms": props.multi_processor_count,
        "l2_bytes": l2,
    }
    copy_bw, mm_rate = measure_ceilings()
    meta["copy_bw_GBps"] = copy_bw / 1e9
    meta["bf16_tflops"] = mm_rate / 1e12
    log(f"{meta}")
    return meta, copy_bw, mm_rate, l2


def select_shapes(names: str):
    return SHAPES if names == "all" else [s for s in SHAPES if s[0] in names.split(",")]


def plot_panels(path, title, curves, panels):
    """Two log-log panels against M: ``curves`` maps a label to (ms, left values, right
    values); ``panels`` is ((title, reference lines), (title, reference lines))."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for label, (ms, left, right) in curves.items():
            axes[0].plot(ms, left, "o-", label=label)
            axes[1].plot(ms, right, "o-", label=label)
        for ax, (panel_title, lines) in zip(axes, panels):
            for y, style in lines:
                ax.axhline(y, color="k" if style == "--" else "gray", ls=style, lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("M (tokens)")
            ax.set_title(panel_title)
        axes[0].legend(fontsize=7)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except Exception as e:
        print(f"plot skipped: {e!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--shapes", default="all", help="comma-separated shape names, or all")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16-activation comparison")
    ap.add_argument(
        "--configs-out",
        default=None,
        help="folder to write this GPU's table of the configs tuned here (w4a16.tables format)",
    )
    args = ap.parse_args()
    meta, copy_bw, mm_rate, l2 = gpu_meta(log)
    shapes = select_shapes(args.shapes)
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for name, K, N in shapes:
        rows += bench_shape(name, K, N, ms, copy_bw, mm_rate, l2, log)
        with open(os.path.join(args.out, "w4a16-partial.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f)
    extra = [] if args.no_bf16 else bf16_extra(log)
    meta["kernel_ok"] = {str(k): v for k, v in TK._KERNEL_OK.items()}
    summary = summarize(rows)
    base = write_outputs(args.out, meta, rows, extra, summary)
    for s in summary:
        log(s)
    log(f"wrote {base}.json/.md/.png")
    if args.configs_out:
        tuned = {}
        for r in rows:
            if r.get("config"):
                tuned.setdefault((r["N"], r["K"], G), {})[r["M"]] = tuple(r["config"])
        source = (
            f"benchmarks/bench_w4a16.py {meta['date']}, torch {meta['torch']}, triton "
            f"{meta['triton']}: fp16 activations, AWQ layout, random weights rotated past L2"
        )
        path = os.path.join(args.configs_out, T.file_name(meta["gpu"]))
        log(f"wrote {T.write_table(path, meta['gpu'], tuned, source)}")


if __name__ == "__main__":
    main()
