"""W4A16 benchmark: fp16 cuBLAS vs torch tinygemm vs quantfw's Triton kernels vs the floor.

One run measures, on the GPU at hand:
  * the floor's two ceilings: device-to-device copy bandwidth (bytes read + written) and the
    bf16 matmul rate (8192^3 on random data);
  * for Qwen3-8B and Llama-3-70B TP=8 shard shapes and M in {1, 4, 16, 64, 256, 1024, 4096}:
    fp16 cuBLAS (F.linear), torch tinygemm (_weight_int4pack_mm, bf16), ours (fp16, AWQ layout,
    group 128), and floor = max(int4 bytes / copy bandwidth, flops / bf16 rate).
Each method is timed as CUDA-graph replays of many calls that rotate over enough weight copies
that L2 cannot hold them (launch overhead excluded for every method alike); median of replays.
Our configs are tuned per (M bucket, shape) first (warm-up), then timed.

Writes <out>/w4a16-<gpu>-<date>.json, .md and .png.  Not a test: run on a GPU machine, e.g.
``python benchmarks/bench_w4a16.py --out benchmarks/results``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from quantfw.kernels import w4a16 as W  # noqa: E402

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


def _events_median(fn, iters=7):
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    fn()
    torch.cuda.synchronize()
    for i in range(iters):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end)) * 1e3  # us


def measure_ceilings():
    n = 1 << 29  # 1 GiB of bf16... 512 Mi elements * 2 B
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_()
    b = torch.empty_like(a)
    t_us = _events_median(lambda: b.copy_(a), iters=10)
    copy_bw = 2 * a.numel() * 2 / (t_us * 1e-6)
    a = b = None
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_us = _events_median(lambda: x @ y, iters=10)
    mm_rate = 2 * 8192**3 / (t_us * 1e-6)
    x = y = None
    torch.cuda.empty_cache()
    return copy_bw, mm_rate


def graph_time(calls, est_us):
    """Median time of one call (us): CUDA graph of `reps` calls rotating over `calls`."""
    n = len(calls)
    reps = n * max(1, math.ceil(400.0 / max(est_us, 1.0) / n))
    reps = min(reps, max(n, 2000))
    for c in calls:
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            calls[i % n]()
    t = _events_median(g.replay, iters=7)
    del g
    return t / reps


def rotated_timer(TK, x, packs, est_us):
    """tune()'s timer: one config's time per call over the rotated weight copies."""

    def time_config(cfg):
        return graph_time(
            [lambda p=p: TK.w4a16_matmul_cuda(x, p, config=cfg) for p in packs], est_us
        )

    return time_config


def random_awq(K, N, device):
    ng = K // G
    qw = torch.randint(-(2**31), 2**31 - 1, (K, N // 8), dtype=torch.int32, device=device)
    qz = torch.randint(-(2**31), 2**31 - 1, (ng, N // 8), dtype=torch.int32, device=device)
    sc = (torch.rand(ng, N, device=device) * 0.01 + 0.001).half()
    return W.repack_awq(qw, qz, sc, G)


def n_copies(nbytes, l2):
    return max(2, min(64, math.ceil(3 * l2 / nbytes)))


def bench_shape(name, K, N, ms, copy_bw, mm_rate, l2, log):
    from quantfw.kernels.triton import w4a16_kernels as TK

    dev = "cuda"
    rows = []
    int4_bytes = K * N // 2 + (K // G) * N * 2 + (K // G) * N // 2
    packs = [random_awq(K, N, dev) for _ in range(n_copies(int4_bytes, l2))]
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
    for M in ms:
        x = torch.randn(M, K, device=dev, dtype=torch.float16)
        xb = x.to(torch.bfloat16)
        bytes_min = int4_bytes + M * K * 2 + M * N * 2
        floor_us = max(bytes_min / copy_bw, 2 * M * N * K / mm_rate) * 1e6
        t0 = time.time()
        cfg = TK.tune(x, packs[0], bench=rotated_timer(TK, x, packs, floor_us))
        tune_s = time.time() - t0
        ours = graph_time([lambda p=p, x=x: W.w4a16_matmul(x, p) for p in packs], floor_us)
        fp16 = graph_time([lambda w=w, x=x: F.linear(x, w) for w in fp16_ws], floor_us)
        tiny = None
        if tg:
            try:
                tiny = graph_time(
                    [
                        lambda wp=wp, sz=sz, xb=xb: torch.ops.aten._weight_int4pack_mm(
                            xb, wp, G, sz
                        )
                        for wp, sz in tg
                    ],
                    floor_us,
                )
            except Exception as e:
                log(f"  tinygemm failed at M={M}: {e!r:.200}")
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
            "ours_over_floor": ours / floor_us,
            "ours_over_fp16": ours / fp16,
            "fp16_over_ours": fp16 / ours,
            "config": list(cfg) if cfg else None,
            "tune_s": tune_s,
        }
        rows.append(row)
        tiny_s = f"{tiny:9.1f}" if tiny else "      n/a"
        log(
            f"  {name:24s} M={M:5d} fp16 {fp16:9.1f}  tinygemm {tiny_s}  ours {ours:9.1f}"
            f"  floor {floor_us:8.1f}  ours/floor {ours / floor_us:5.2f}  ours/fp16 "
            f"{ours / fp16:5.2f}  cfg {cfg}"
        )
    del packs, fp16_ws, tg
    torch.cuda.empty_cache()
    return rows


def bf16_extra(log):
    """Ours with bf16 activations next to fp16 (gate_up shape): time and error."""
    out = []
    K, N = 4096, 24576
    packs = [random_awq(K, N, "cuda") for _ in range(3)]
    wref = W.dequantize_packed(packs[0], torch.float32)
    for M in (1, 16, 1024):
        res = {}
        for dtype in (torch.float16, torch.bfloat16):
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


def summarize(rows):
    qwen = [r for r in rows if "M" in r and r["shape"].startswith("qwen3")]
    lines = []
    small = [r for r in qwen if r["M"] in (1, 16)]
    ok_small = [r for r in small if r["ours_over_floor"] <= 1.33]
    lines.append(
        f"M in (1, 16), Qwen3-8B: {len(ok_small)}/{len(small)} within 1.33x floor; worst "
        f"{max(r['ours_over_floor'] for r in small):.2f}x"
    )
    big = [r for r in rows if "M" in r and r["M"] >= 1024]
    ok_big = [r for r in big if r["ours_over_fp16"] <= 1.15]
    lines.append(
        f"M >= 1024: {len(ok_big)}/{len(big)} within 1.15x fp16; worst "
        f"{max((r['ours_over_fp16'] for r in big), default=float('nan')):.2f}x"
    )
    mid = [r for r in rows if "M" in r]
    bad = [
        r
        for r in mid
        if r["ours_fp16_us"] > r["fp16_cublas_us"]
        and r["tinygemm_bf16_us"] is not None
        and r["ours_fp16_us"] > r["tinygemm_bf16_us"]
    ]
    lines.append(f"shapes slower than both fp16 and tinygemm: {len(bad)}")
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
            "| ours/fp16 |\n|---|---|---|---|---|---|---|---|\n"
        )
        for r in perf:
            tiny = f"{r['tinygemm_bf16_us']:.1f}" if r["tinygemm_bf16_us"] else "n/a"
            f.write(
                f"| {r['shape']} | {r['M']} | {r['fp16_cublas_us']:.1f} | {tiny} | "
                f"{r['ours_fp16_us']:.1f} | {r['floor_us']:.1f} | {r['ours_over_floor']:.2f} | "
                f"{r['ours_over_fp16']:.2f} |\n"
            )
        f.write("\n" + "\n".join(f"- {s}" for s in summary) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for name in dict.fromkeys(r["shape"] for r in perf):
            rs = [r for r in perf if r["shape"] == name]
            axes[0].plot([r["M"] for r in rs], [r["ours_over_floor"] for r in rs], "o-", label=name)
            axes[1].plot([r["M"] for r in rs], [r["ours_over_fp16"] for r in rs], "o-", label=name)
        axes[0].axhline(1.33, color="k", ls="--", lw=0.8)
        axes[1].axhline(1.15, color="k", ls="--", lw=0.8)
        axes[1].axhline(1.0, color="gray", ls=":", lw=0.8)
        for ax, t in zip(axes, ("ours / floor", "ours / fp16 cuBLAS")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("M (tokens)")
            ax.set_title(t)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"W4A16 on {meta['gpu']} {meta['date']}")
        fig.tight_layout()
        fig.savefig(base + ".png", dpi=110)
    except Exception as e:
        print(f"plot skipped: {e!r}")
    return base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--shapes", default="all", help="comma-separated shape names, or all")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16-activation comparison")
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "date": dt.date.today().isoformat(),
        "torch": torch.__version__,
        "sms": props.multi_processor_count,
        "l2_bytes": l2,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass

    def log(s):
        print(s, flush=True)

    copy_bw, mm_rate = measure_ceilings()
    meta["copy_bw_GBps"] = copy_bw / 1e9
    meta["bf16_tflops"] = mm_rate / 1e12
    log(f"{meta}")
    shapes = (
        SHAPES if args.shapes == "all" else [s for s in SHAPES if s[0] in args.shapes.split(",")]
    )
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for name, K, N in shapes:
        rows += bench_shape(name, K, N, ms, copy_bw, mm_rate, l2, log)
        with open(os.path.join(args.out, "w4a16-partial.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f)
    extra = [] if args.no_bf16 else bf16_extra(log)
    from quantfw.kernels.triton import w4a16_kernels as TK

    meta["kernel_ok"] = {str(k): v for k, v in TK._KERNEL_OK.items()}
    summary = summarize(rows)
    base = write_outputs(args.out, meta, rows, extra, summary)
    for s in summary:
        log(s)
    log(f"wrote {base}.json/.md/.png")


if __name__ == "__main__":
    main()
