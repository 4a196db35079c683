"""Run with TRITON_INTERPRET=1 (Triton's CPU interpreter): the kbit Triton kernels on small
random weights against the torch reference (repack and dequantize exactly, the fused GEMM to
fp16 rounding with SWAP off and on, split-K workspace left clean). Exits non-zero with a message on a mismatch."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))
from script_checks import patch_interpreter_scalar_index  # noqa: E402

from quantfw.kernels.common import splitk  # noqa: E402
from quantfw.kernels.kbit import format as kfmt  # noqa: E402
from quantfw.kernels.kbit import layout  # noqa: E402
from quantfw.kernels.kbit.triton import dispatch  # noqa: E402


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def check(cond: bool, what: str) -> None:
    if not cond:
        print(f"FAIL: {what}", flush=True)
        sys.exit(1)


def rel_max(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: a stale or unwritten element shows here."""
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max())


def main() -> None:
    patch_interpreter_scalar_index()
    gen = torch.Generator().manual_seed(0)
    cases = [(2, 200, 320), (3, 72, 288), (4, 136, 192), (5, 64, 480)]  # bits, N, K (padded)
    # (config, SMs, M): split-K off and on, SWAP off and on, 16- and 32-token tiles, 32..128
    # columns, block_k 128 and 256, several token tiles, and the deq path
    runs = [
        (("fused", 16, 64, 128, 4, 1, 1, False), 1, 1),
        (("fused", 16, 32, 128, 4, 2, 64, True), 16, 3),
        (("fused", 32, 128, 128, 4, 2, 64, False), 16, 17),
        (("fused", 16, 64, 256, 4, 2, 1, True), 1, 40),
        (("deq", 64, 128, 4), 1, 19),
    ]
    for bits, N, K in cases:
        w = torch.randn(N, K, generator=gen) * 0.05
        planes, absmax = kfmt.quantize(w, bits)
        cb = kfmt.normal_float_codebook(bits)
        ref = layout.repack(planes, absmax, cb)
        got = dispatch.repack(planes, absmax, cb)
        check(torch.equal(got.qweight, ref.qweight), f"repack qweight bits={bits} N={N} K={K}")
        check(torch.equal(got.scales, ref.scales), f"repack scales bits={bits} N={N} K={K}")
        w_ref = kfmt.dequantize(planes, absmax, cb, torch.float32)
        for bn, bk in ((128, 128), (32, 256)):
            d = dispatch.dequantize(ref, torch.float32, bn, bk, 4)
            check(torch.equal(d, w_ref), f"dequantize bits={bits} block {bn}x{bk}")
        d16 = dispatch.dequantize(ref, torch.float16, 64, 128, 4)
        check(torch.equal(d16, w_ref.half()), f"dequantize fp16 bits={bits}")
        for cfg, sms, M in runs:
            x = torch.randn(M, K, generator=gen).half()
            bias = torch.randn(N, generator=gen).half()
            want = x.double() @ w_ref.double().t() + bias.double()
            if cfg[0] == "fused":
                tiles = -(-N // cfg[2]) * -(-M // cfg[1])
                steps = ref.padded_blocks * 32 // cfg[3]
                split, _ = splitk.split_plan(steps, tiles, sms, cfg[6])
                check((split > 1) == (sms > 1), f"{cfg} sms={sms}: split {split}")
            out = dispatch.gemm(x, ref, bias, cfg, sms=sms)
            what = f"gemm bits={bits} N={N} K={K} M={M} {cfg} sms={sms}"
            check(out.shape == (M, N) and out.dtype == torch.float16, f"{what}: shape/dtype")
            err, worst = rel_err(out, want), rel_max(out, want)
            check(err < 2e-3 and worst < 5e-3, f"{what}: {err:.2e} (max {worst:.2e})")
            ws, cnt = splitk.WORKSPACE.get("cpu", (torch.zeros(1), torch.zeros(1)))
            check(not ws.any() and not cnt.any(), f"workspace left dirty by {cfg} sms={sms}")
        out = dispatch.gemm(x, ref, None, ("fused", 16, 64, 128, 4, 2, 8, True), sms=4)
        check(rel_err(out, x.double() @ w_ref.double().t()) < 2e-3, "gemm without bias")
        print(f"bits={bits} N={N} K={K}: ok", flush=True)
    print("ALL OK")


if __name__ == "__main__":
    main()
