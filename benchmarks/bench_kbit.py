"""kbit benchmark: K = 2..5 against fp16 cuBLAS, our W4A16 (for K = 4), dequantize + cuBLAS,
and each K's bandwidth floor.

Same harness and shapes as ``bench_w4a16.py``; by default (about 3 minutes on an H200, most
of it Triton compiles) the Qwen3-8B gate_up and down shapes at M in {1, 4, 16, 64, 256, 1024}
(``--shapes all --ms 1,4,16,64,256,1024,4096`` for the full set). Every method is timed as
CUDA-graph replays of calls rotating over enough weight copies that L2 cannot hold them, the
methods of a row in interleaved rounds (order rotated, 20 ms of idle GPU before each;
``common.timing``).
Methods per (shape, K, M):

* ``fp16``: ``F.linear`` on an fp16 weight (cuBLAS);
* ``kbit``: ``kbit_matmul_cuda`` with the config ``tune()`` picked for this M bucket among
  ``configs.candidate_configs`` (fused with SWAP on and off, deq; timed with the same rotated
  timer); ``kbit_default``: the config a call gets without tuning;
* ``kbit_deq``: the ``("deq", ...)`` path (dequantize into a dense fp16 weight, then cuBLAS);
* ``w4a16`` (K = 4): our AWQ kernels on a group-128 AWQ weight of the same shape, with the
  config a call gets without tuning (the shipped H200 table covers these shapes);
* floor: ``max(bytes / copy bandwidth, 2MNK / bf16 rate)``, bytes = the kbit weight (K/8 bits
  per weight + one E4M4 byte per 32) + x + out, both rates measured in the same run.

Writes ``<out>/kbit-<gpu>-<date>.json``, ``.md`` and ``.png``; ``--configs-out DIR`` writes the
tuned configs as this GPU's kbit table. Not a test: run on a GPU machine, e.g.
``python benchmarks/bench_kbit.py --out benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_w4a16 import gpu_meta, log, plot_panels, select_shapes  # noqa: E402

from quantfw.kernels import kbit  # noqa: E402
from quantfw.kernels import w4a16 as W  # noqa: E402
from quantfw.kernels.common import is_sm90  # noqa: E402
from quantfw.kernels.common.timing import graph_time, graph_times, n_copies  # noqa: E402
from quantfw.kernels.kbit import tables as KT  # noqa: E402
from quantfw.kernels.kbit.configs import candidate_configs  # noqa: E402
from quantfw.kernels.kbit.triton import dispatch as KD  # noqa: E402
from quantfw.kernels.kbit.triton.tuning import random_kbit  # noqa: E402
from quantfw.kernels.w4a16.triton.tuning import packed_bytes, random_awq  # noqa: E402

BITS = [2, 3, 4, 5]
SHAPES = "qwen3-8b.gate_up,qwen3-8b.down"
MS = [1, 4, 16, 64, 256, 1024]
G = 128  # W4A16 group size


def kbit_bytes(N: int, K: int, bits: int) -> int:
    """The floor's weight bytes: K/8 bytes of indices and one E4M4 byte per 32 weights."""
    return N * K * bits // 8 + N * K // 32


def check_errors(name, K, N, bits, weights, log):
    """Relative error of the kernels (default configs) against the fp32 dequantized weight."""
    rows = []
    ref = kbit.dequantize_weight(weights[0], torch.float32)
    for m in (1, 7, 33, 300):
        x = torch.randn(m, K, device="cuda", dtype=torch.float16)
        want = x.float() @ ref.t()
        err = ((kbit.kbit_matmul(x, weights[0]).float() - want).norm() / want.norm()).item()
        log(f"  {name} K={bits} M={m} rel err vs fp32 reference: {err:.2e}")
        rows.append({"shape": name, "bits": bits, "check_M": m, "rel_err_fp16": err})
        if not err < 2e-3:
            raise SystemExit(f"{name} K={bits} M={m}: relative error {err:.2e} (> 2e-3): wrong")
    return rows


def bench_shape(name, K, N, ms, bits_list, copy_bw, mm_rate, l2, log):
    rows = []
    fp16_ws = [
        torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        for _ in range(n_copies(K * N * 2, l2))
    ]
    awq = None
    if 4 in bits_list:
        awq = [random_awq(K, N, G, "cuda") for _ in range(n_copies(packed_bytes(K, N, G), l2))]
    device_name = torch.cuda.get_device_name()
    # timed as CUDA-graph replays, so the defaults are those of calls made for graphs
    graphed = is_sm90(torch.device("cuda"))
    for bits in bits_list:
        wbytes = kbit.tiled_nbytes(N, K, bits)
        weights = [random_kbit(N, K, bits, "cuda") for _ in range(n_copies(wbytes, l2))]
        rows += check_errors(name, K, N, bits, weights, log)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            floor_bytes = kbit_bytes(N, K, bits) + 2 * M * (K + N)
            floor_us = max(floor_bytes / copy_bw, 2 * M * N * K / mm_rate) * 1e6

            def run(cfg, x=x, weights=weights):
                return [lambda w=w: KD.kbit_matmul_cuda(x, w, config=cfg) for w in weights]

            n_cands = len(candidate_configs(M, bits, graphed))
            log(f"  {name} K={bits} M={M}: tuning {n_cands} configs ...")
            t0 = time.time()
            cfg = KD.tune(
                x, weights[0], bench=lambda c, run=run, est=floor_us: graph_time(run(c), est)
            )
            tune_s = time.time() - t0
            default_cfg = KT.untuned_config(device_name, M, N, K, bits, graphed)
            deq_cfg = ("deq", 128, 128, 8)
            methods = {
                "fp16": [lambda w=w, x=x: F.linear(x, w) for w in fp16_ws],
                "kbit": run(cfg),
                "kbit_default": run(default_cfg),
                "kbit_deq": run(deq_cfg),
            }
            if bits == 4 and awq is not None:
                methods["w4a16"] = [lambda p=p, x=x: W.w4a16_matmul(x, p) for p in awq]
            t = dict(zip(methods, graph_times(list(methods.values()), floor_us)))
            row = {
                "shape": name,
                "K": K,
                "N": N,
                "M": M,
                "bits": bits,
                "fp16_cublas_us": t["fp16"],
                "kbit_us": t["kbit"],
                "kbit_default_us": t["kbit_default"],
                "kbit_deq_us": t["kbit_deq"],
                "w4a16_us": t.get("w4a16"),
                "floor_us": floor_us,
                "kbit_over_floor": t["kbit"] / floor_us,
                "kbit_over_fp16": t["kbit"] / t["fp16"],
                "fp16_over_kbit": t["fp16"] / t["kbit"],
                "kbit_over_deq": t["kbit"] / t["kbit_deq"],
                "config": list(cfg) if cfg else None,
                "default_config": list(default_cfg),
                "tune_s": tune_s,
            }
            rows.append(row)
            w4 = f"  w4a16 {t['w4a16']:8.1f}" if "w4a16" in t else ""
            log(
                f"  {name:24s} K={bits} M={M:5d} fp16 {t['fp16']:8.1f}  kbit {t['kbit']:8.1f}"
                f"  default {t['kbit_default']:8.1f}  deq {t['kbit_deq']:8.1f}{w4}"
                f"  floor {floor_us:7.1f}  kbit/floor {t['kbit'] / floor_us:5.2f}"
                f"  fp16/kbit {t['fp16'] / t['kbit']:5.2f}  cfg {cfg}"
            )
        del weights
        torch.cuda.empty_cache()
    del fp16_ws, awq
    torch.cuda.empty_cache()
    return rows


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(rows):
    perf = [r for r in rows if "M" in r]
    lines = []
    for bits in BITS:
        small = [r for r in perf if r["bits"] == bits and r["M"] <= 16]
        if small:
            ok = [r for r in small if r["kbit_over_floor"] <= 1.5]
            lines.append(
                f"K={bits}, M <= 16: {len(ok)}/{len(small)} within 1.5x floor; worst "
                f"{max(r['kbit_over_floor'] for r in small):.2f}x; fp16/kbit geomean "
                f"{_geomean([r['fp16_over_kbit'] for r in small]):.2f}x"
            )
    big = [r for r in perf if r["M"] >= 1024]
    if big:
        ok = [r for r in big if r["kbit_over_fp16"] <= 1.3]
        lines.append(
            f"M >= 1024: {len(ok)}/{len(big)} within 1.3x fp16; worst "
            f"{max(r['kbit_over_fp16'] for r in big):.2f}x"
        )
    # a row whose chosen config is the dequantize path times that path twice
    other = [r for r in perf if not (r["config"] and r["config"][0] == "deq")]
    slower = [r for r in other if r["kbit_over_deq"] > 1.0]
    lines.append(
        f"rows slower than dequantize + cuBLAS: {len(slower)} of the {len(other)} not on it"
        + "".join(f"; {r['shape']} K={r['bits']} M={r['M']}" for r in slower)
    )
    k4 = [r for r in perf if r["bits"] == 4 and r.get("w4a16_us")]
    if k4:
        lines.append(
            "K=4 against our W4A16 (kbit / w4a16): geomean "
            f"{_geomean([r['kbit_us'] / r['w4a16_us'] for r in k4]):.2f}x"
        )
    m1 = [r for r in perf if r["M"] == 1]
    for bits in sorted({r["bits"] for r in m1}):
        rs = [r for r in m1 if r["bits"] == bits]
        lines.append(
            f"K={bits}, M=1: fp16/kbit {min(r['fp16_over_kbit'] for r in rs):.2f}x.."
            f"{max(r['fp16_over_kbit'] for r in rs):.2f}x"
        )
    ratios = [r["kbit_default_us"] / r["kbit_us"] for r in perf]
    if ratios:
        lines.append(
            f"default config / tuned: geomean {_geomean(ratios):.2f}x, worst {max(ratios):.2f}x"
        )
    return lines


def write_outputs(out_dir, meta, rows, summary):
    os.makedirs(out_dir, exist_ok=True)
    gpu = meta["gpu"].replace(" ", "_").replace("/", "_")
    base = os.path.join(out_dir, f"kbit-{gpu}-{meta['date']}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summary}, f, indent=1)
    perf = [r for r in rows if "M" in r]
    with open(base + ".md", "w") as f:
        f.write(f"# kbit on {meta['gpu']} ({meta['date']})\n\n")
        f.write(
            f"copy bandwidth {meta['copy_bw_GBps']:.0f} GB/s, bf16 matmul "
            f"{meta['bf16_tflops']:.0f} TFLOP/s; times in us (CUDA-graph replays, weights "
            "rotated past L2); fp16 activations\n\n"
        )
        f.write(
            "| shape | K | M | fp16 cuBLAS | kbit (tuned) | kbit default | deq + cuBLAS | W4A16 "
            "| floor | kbit/floor | fp16/kbit | config |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        )
        for r in perf:
            w4 = f"{r['w4a16_us']:.1f}" if r.get("w4a16_us") else "-"
            f.write(
                f"| {r['shape']} | {r['bits']} | {r['M']} | {r['fp16_cublas_us']:.1f} | "
                f"{r['kbit_us']:.1f} | {r['kbit_default_us']:.1f} | {r['kbit_deq_us']:.1f} | "
                f"{w4} | {r['floor_us']:.1f} | {r['kbit_over_floor']:.2f} | "
                f"{r['fp16_over_kbit']:.2f} | `{r['config']}` |\n"
            )
        f.write("\n" + "\n".join(f"- {s}" for s in summary) + "\n")
    curves = {}
    for bits in sorted({r["bits"] for r in perf}):
        for name in dict.fromkeys(r["shape"] for r in perf if r["shape"].endswith("gate_up")):
            rs = [r for r in perf if r["shape"] == name and r["bits"] == bits]
            curves[f"{name} K={bits}"] = (
                [r["M"] for r in rs],
                [r["kbit_over_floor"] for r in rs],
                [r["fp16_over_kbit"] for r in rs],
            )
    panels = (
        ("kbit / floor", [(1.5, "--")]),
        ("fp16 cuBLAS / kbit (speed-up)", [(1.0, ":")]),
    )
    title = f"kbit on {meta['gpu']} {meta['date']} (gate_up shapes)"
    plot_panels(base + ".png", title, curves, panels)
    return base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    )
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated shape names, or all")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--bits", default=",".join(map(str, BITS)))
    ap.add_argument("--configs-out", default=None, help="folder for this GPU's kbit config table")
    args = ap.parse_args()
    meta, copy_bw, mm_rate, l2 = gpu_meta(log)
    shapes = select_shapes(args.shapes)
    ms = [int(m) for m in args.ms.split(",")]
    bits_list = [int(b) for b in args.bits.split(",")]
    rows = []
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    for i, (name, K, N) in enumerate(shapes):
        log(f"[{time.time() - start:6.0f} s] shape {i + 1}/{len(shapes)}: {name} (K={K}, N={N})")
        rows += bench_shape(name, K, N, ms, bits_list, copy_bw, mm_rate, l2, log)
        with open(os.path.join(args.out, "kbit-partial.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f)
    log(f"[{time.time() - start:6.0f} s] done")
    summary = summarize(rows)
    base = write_outputs(args.out, meta, rows, summary)
    for s in summary:
        log(s)
    log(f"wrote {base}.json/.md/.png")
    if args.configs_out:
        tuned = {}
        for r in rows:
            if r.get("config"):
                tuned.setdefault((r["N"], r["K"], r["bits"]), {})[r["M"]] = tuple(r["config"])
        source = (
            f"benchmarks/bench_kbit.py {meta['date']}, torch {meta['torch']}, triton "
            f"{meta['triton']}: fp16 activations, random weights rotated past L2"
        )
        path = os.path.join(args.configs_out, KT.TABLES.file_name(meta["gpu"]))
        log(f"wrote {KT.TABLES.write_table(path, meta['gpu'], tuned, source)}")


if __name__ == "__main__":
    main()
