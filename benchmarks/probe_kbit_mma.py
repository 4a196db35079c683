"""GPU probe of the kbit Gluon mma kernel (``kbit/triton/mma.py``): correctness against the
float32 reference over M, bits, dtypes and configs, then timings (CUDA-graph replays over
weights rotated past L2) of CONFIGS against fp16 cuBLAS and the bandwidth floor.

    python benchmarks/probe_kbit_mma.py --bits 4,2,3,5 --ms 1,8
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch

from quantfw.kernels.common import timing
from quantfw.kernels.kbit import configs as C
from quantfw.kernels.kbit import layout
from quantfw.kernels.kbit.triton import dispatch
from quantfw.kernels.kbit.triton import mma as KM
from quantfw.kernels.kbit.triton.tuning import random_kbit


def check(N, K, bits, M, dtype, cfg, bias):
    w = random_kbit(N, K, bits, "cuda")
    ref_w = layout.dequantize_weight(w, torch.float32)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, device="cuda", dtype=dtype) if bias else None
    lut = KM.lookup_table(w.codebook, bits, dtype)
    out = KM.kbit_mma_matmul(x, w.qweight, w.scales, lut, N, bits, b, **cfg)
    out2 = KM.kbit_mma_matmul(x, w.qweight, w.scales, lut, N, bits, b, **cfg)  # clean buffers
    ref = x.float() @ ref_w.t() + (b.float() if bias else 0)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    err2 = ((out2.float() - ref).norm() / ref.norm()).item()
    finite = bool(torch.isfinite(out).all())
    return max(err, err2), finite


#: name: keyword options of `kbit_mma_matmul` (table copies: the default of each K)
CONFIGS = {
    "c2": dict(ctas_per_sm=2),
    "c3": dict(ctas_per_sm=3),
    "c4": dict(ctas_per_sm=4),
    # two quads of blocks per chunk: twice the bytes in flight per warp, 32 more registers
    "ch8c2": dict(chunk=8, ctas_per_sm=2),
    "ch8c3r168": dict(chunk=8, ctas_per_sm=3, maxnreg=168),
    # what a small shape's time is made of: table fill (copies), CTAs (split), CTA size
    "r1": dict(copies=1),
    "r8": dict(copies=8),
    "c1": dict(ctas_per_sm=1),
    "w8c2": dict(warps=8, ctas_per_sm=2),
    # narrower CTAs, more of them: a smaller split along K at one token
    "w2c6": dict(warps=2, ctas_per_sm=6),
    "w1c12r8": dict(warps=1, ctas_per_sm=12, copies=8),
    # a block per warp, the split along K across CTAs only (the default "c3" puts the 4 warps
    # of a CTA on one column block, its chunks split among them)
    "c3wk1": dict(ctas_per_sm=3, wk=1),
}


def _copies(bits):
    """The default config's table copies at K = `bits`."""
    return C.default_config(1, 0, 0, bits)[4]


def _mma_call(x, w, opts):
    """The mma kernel with explicit options."""
    opts = {"copies": _copies(w.bits), **opts}
    lut = dispatch._lookup_table(w, x.dtype)
    return functools.partial(
        KM.kbit_mma_matmul, x, w.qweight, w.scales, lut, w.out_features, w.bits, None, **opts
    )


def time_shape(K, N, bits, M, l2, configs):
    """Times (us) of fp16 cuBLAS and the mma kernel with each of `configs`."""
    nbytes = layout.tiled_nbytes(N, K, bits)
    ws = [random_kbit(N, K, bits, "cuda") for _ in range(timing.n_copies(nbytes, l2))]
    n_dense = timing.n_copies(N * K * 2, l2)
    dense = [torch.randn(N, K, device="cuda", dtype=torch.float16) for _ in range(n_dense)]
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    methods = [[functools.partial(torch.nn.functional.linear, x, d) for d in dense]]
    for opts in configs.values():
        methods.append([_mma_call(x, w, opts) for w in ws])
    return timing.graph_times(methods, timing.rough_time_us(nbytes, M, N, K))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ms", default="1,16", help="token counts to time")
    ap.add_argument("--bits", default="4,2", help="bit widths to check and time")
    ap.add_argument("--configs", default="c3,c4", help=f"names of CONFIGS to time: {list(CONFIGS)}")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down", help="Qwen3-8B shapes, or k512")
    ap.add_argument("--no-check", action="store_true", help="time only")
    args = ap.parse_args()
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    bitss = [int(b) for b in args.bits.split(",")]
    torch.manual_seed(0)
    fails = 0
    cases = []
    for bits, dtype in itertools.product(bitss, (torch.float16, torch.bfloat16)):
        for M in (1, 3, 8, 9, 16):
            cases.append((384, 1024, bits, M, dtype, {}, M == 3))
    for bits in bitss:
        for cfg in (
            dict(copies=_copies(bits)),
            dict(chunk=8),
            dict(chunk=8, ctas_per_sm=3, maxnreg=168),
            dict(pipe=True),
            dict(warps=8, ctas_per_sm=2, copies=_copies(bits)),
            dict(copies=4, pipe=True, chunk=8),
            dict(copies=4, pipe=True, maxnreg=128),
            dict(wk=2),
            dict(wk=1),
            dict(wk=4, chunk=8),
        ):
            cases.append((640, 2080, bits, 5, torch.float16, cfg, True))
            cases.append((4096, 4096, bits, 1, torch.bfloat16, cfg, False))
    for N, K, bits, M, dtype, cfg, bias in [] if args.no_check else cases:
        try:
            err, finite = check(N, K, bits, M, dtype, cfg, bias)
            ok = finite and err < 3e-3
        except Exception as e:  # noqa: BLE001
            err, ok = repr(e)[:300], False
        fails += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} N={N} K={K} bits={bits} M={M} {str(dtype)[6:]} {cfg} bias={bias}: {err}"
        )
    if not args.no_check:
        print(f"correctness: {len(cases) - fails}/{len(cases)} ok", flush=True)

    # timings: Qwen3-8B shapes, M = 1 (and 16)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    shapes = {
        "qkv": (4096, 6144),
        "o": (4096, 4096),
        "gate_up": (4096, 24576),
        "down": (12288, 4096),
        "k512": (512, 4096),  # little but fixed costs
    }
    shapes = [(name, *shapes[name]) for name in args.shapes.split(",")]
    head = " ".join(f"{k:>7}" for k in configs)
    print(f"{'shape':8} {'bits':4} {'M':>3} {'fp16':>7} {head}  floor (us at 3.9 TB/s)")
    ms = [int(m) for m in args.ms.split(",")]
    for (name, K, N), bits, M in itertools.product(shapes, bitss, ms):
        ts = time_shape(K, N, bits, M, l2, configs)
        floor = layout.tiled_nbytes(N, K, bits) / 3.9e6
        print(
            f"{name:8} {bits:4} {M:3} " + " ".join(f"{t:7.1f}" for t in ts) + f"  {floor:.1f}",
            flush=True,
        )
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
