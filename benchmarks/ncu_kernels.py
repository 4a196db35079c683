"""Launch one kernel of a quantized GEMM a few times on fresh random data, for Nsight Compute.

    ncu --clock-control none -k regex:kbit_mma --launch-skip 2 --launch-count 1 \\
        python benchmarks/ncu_kernels.py kbit4 --n 24576 --k 4096 --m 1

Methods: ``kbit2``..``kbit5`` (the config of ``--config``, else the default one), ``w4a16``
(group 128), ``fp16`` (cuBLAS). Each launch reads a fresh weight copy, so none is L2-resident.
"""

from __future__ import annotations

import argparse
import ast

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("method")
    p.add_argument("--n", type=int, default=24576)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--launches", type=int, default=4)
    p.add_argument(
        "--config", default=None, help="a kbit config tuple, e.g. \"('mma',4,4,4,32,False)\""
    )
    a = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.m, a.k, device="cuda", dtype=torch.float16)
    if a.method.startswith("kbit"):
        from quantfw.kernels.kbit.triton import dispatch
        from quantfw.kernels.kbit.triton.tuning import random_kbit

        cfg = ast.literal_eval(a.config) if a.config else None
        ws = [random_kbit(a.n, a.k, int(a.method[4:]), "cuda") for _ in range(a.launches)]
        calls = [lambda w=w: dispatch.kbit_matmul_cuda(x, w, None, cfg) for w in ws]
    elif a.method == "w4a16":
        from quantfw.kernels.w4a16.triton.dispatch import w4a16_matmul_cuda
        from quantfw.kernels.w4a16.triton.tuning import random_awq

        ws = [random_awq(a.k, a.n, 128, "cuda") for _ in range(a.launches)]
        calls = [lambda w=w: w4a16_matmul_cuda(x, w) for w in ws]
    elif a.method == "fp16":
        ws = [torch.randn(a.n, a.k, device="cuda", dtype=torch.float16) for _ in range(a.launches)]
        calls = [lambda w=w: torch.nn.functional.linear(x, w) for w in ws]
    else:
        raise SystemExit(f"unknown method {a.method!r}: kbit2..kbit5, w4a16, fp16")
    for call in calls:
        out = call()
    torch.cuda.synchronize()
    print(a.method, tuple(out.shape), float(out.float().abs().mean()))


if __name__ == "__main__":
    main()
