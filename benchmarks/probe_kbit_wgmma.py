"""kbit GEMMs of 17-1024 tokens through the wgmma kernel (`kbit.triton.wgmma`) at Qwen3-8B's
shapes, against fp16 cuBLAS and dequantize + cuBLAS: every wgmma tile config, and which one the
default rule (`kbit.configs.wgmma_tile`) picks. Times are CUDA-graph replays over weight copies
rotated past L2 (`common.timing.graph_times`), in us. Run the same script in two trees for an
A/B (the kernel is compiled by each tree's code).

    python benchmarks/probe_kbit_wgmma.py --bits 4,2 --ms 32,64,128,256,512,1024 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_w4a16 import gpu_meta  # noqa: E402

from quantfw.kernels.common.timing import graph_times, n_copies  # noqa: E402
from quantfw.kernels.kbit import configs, layout  # noqa: E402
from quantfw.kernels.kbit.triton import dispatch  # noqa: E402
from quantfw.kernels.kbit.triton.tuning import random_kbit  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
#: a rank's qkv at TP = 2: 7 stages a CTA (split 5 ways along K), an odd count
SHAPES_TP2 = {"qkv_tp2": (3072, 4096)}
TILES = [configs.WGMMA_64, configs.WGMMA_128, configs.WGMMA_256]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bits", default="4,2")
    p.add_argument("--ms", default="32,64,128,256,512,1024")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {[*SHAPES, *SHAPES_TP2]}")
    p.add_argument("--label", default="")
    p.add_argument("--out", default=".")
    a = p.parse_args()
    meta, bw, mm, l2 = gpu_meta()
    rows = []
    for bits in [int(b) for b in a.bits.split(",")]:
        for name in a.shapes.split(","):
            N, K = {**SHAPES, **SHAPES_TP2}[name]
            wbytes = layout.tiled_nbytes(N, K, bits)
            fp = [
                torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
                for _ in range(n_copies(N * K * 2, l2))
            ]
            ws = [random_kbit(N, K, bits, "cuda") for _ in range(n_copies(wbytes, l2))]
            for M in [int(m) for m in a.ms.split(",")]:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                floor = max((wbytes + 2 * M * (K + N)) / bw, 2 * M * N * K / mm) * 1e6
                methods = {
                    "fp16": [lambda w=w, x=x: F.linear(x, w) for w in fp],
                    "deq": [
                        lambda w=w, x=x: dispatch.kbit_matmul_cuda(
                            x, w, config=("deq", 128, 128, 8)
                        )
                        for w in ws
                    ],
                }
                for cfg in TILES:
                    methods[f"wgmma{cfg[1]}"] = [
                        lambda w=w, c=cfg, x=x: dispatch.kbit_matmul_cuda(x, w, config=c)
                        for w in ws
                    ]
                t = dict(zip(methods, graph_times(list(methods.values()), floor)))
                rule = configs.wgmma_tile(M, N, K, bits)
                row = {"label": a.label, "shape": name, "bits": bits, "M": M, "floor": floor,
                       "rule": None if rule is None else f"wgmma{rule[1]}", **t}  # fmt: skip
                rows.append(row)
                tiles = " ".join(f"{k} {t[k]:7.1f}" for k in t if k.startswith("wgmma"))
                print(
                    f"{a.label} K={bits} {name:8s} M={M:5d} floor {floor:6.1f} fp16 {t['fp16']:7.1f}"
                    f" deq {t['deq']:7.1f} | {tiles} | rule {row['rule']}",
                    flush=True,
                )
            del fp, ws
            torch.cuda.empty_cache()
    path = os.path.join(a.out, f"probe-kbit-wgmma-{a.label or 'run'}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
