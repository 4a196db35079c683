"""What a class of a decode step's small kernels costs with PDL on: run any `quantfw` command
with that class removed, for timing only (the outputs are garbage), or with the decode attention's
span count forced (correct outputs).

    python benchmarks/ablate_step.py --skip norm,rope bench qwen3-8b --methods kbit4 \
        --batch-sizes 1 --prompt-len 128 --decode-context 128 --decode-tokens 128 --no-save

``--skip`` takes any of ``norm`` (every hidden-size RMSNorm and its residual add return their
input, no launch), ``rope`` (no q/k norm + rotary + KV store launch; q passes through, the cache
is not written), ``attn`` (no decode attention: an uninitialised output), ``merge`` (the decode
kernel runs, its split merge is not launched), ``gemm`` (no kbit GEMM launch: an uninitialised
output of its shape; what is left is the step without its kbit weights' streaming). ``--extra G`` launches an empty PDL kernel of G
CTAs after each decode attention; ``--splits N`` runs N spans a (sequence, kv head). ``rope``,
``attn``, ``merge``, ``--extra`` and ``--splits`` act on the Triton attention backend, the one
the engine runs on CUDA. A PDL-off profile gives each kernel's own time; this gives what
removing it saves in the chain of early launches, the upper bound of any fusion of it
(`benchmarks/decode-lab-log.md` experiment 13).
"""

from __future__ import annotations

import argparse
import contextlib
import runpy
import sys
from collections.abc import Collection, Iterator

import torch

SKIPPABLE = ("norm", "rope", "attn", "merge", "gemm")


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _empty_kernel():
    import triton
    import triton.language as tl

    from quantfw.kernels.common import pdl

    @triton.jit
    def empty_kernel(x_ptr, PDL: tl.constexpr):
        pdl.wait_and_release(PDL)

    return empty_kernel


@contextlib.contextmanager
def ablated(
    skip: Collection[str] = (), extra_ctas: int | None = None, splits: int | None = None
) -> Iterator[None]:
    """Patch quantfw's kernel entry points for the duration: `skip` from `SKIPPABLE`,
    `extra_ctas` for an empty kernel after each decode attention, `splits` decode spans."""
    unknown = set(skip) - set(SKIPPABLE)
    if unknown:
        raise ValueError(f"--skip: unknown {sorted(unknown)}; supported: {', '.join(SKIPPABLE)}")
    if "attn" in skip and (extra_ctas is not None or splits is not None):
        raise ValueError(
            "--extra and --splits act on the decode attention, which --skip attn removes"
        )
    from quantfw.kernels import fused
    from quantfw.kernels.attention import triton_paged
    from quantfw.kernels.common import pdl
    from quantfw.kernels.kbit.triton import dispatch as kbit_dispatch
    from quantfw.layers.attention.backends import triton as backend

    saved = [
        (fused, "rms_norm"),
        (backend, "write_kv"),
        (triton_paged, "paged_decode"),
        (triton_paged, "_merge_splits_kernel"),
        (triton_paged, "decode_splits"),
        (kbit_dispatch, "kbit_matmul_cuda"),
    ]
    saved = [(module, name, getattr(module, name)) for module, name in saved]
    try:
        if "norm" in skip:

            def no_norm(x, weight, eps, residual=None, *, weight_in_float32=False):
                return x if residual is None else (x, residual)

            fused.rms_norm = no_norm
        if "rope" in skip:
            backend.write_kv = lambda layer, q, k, v, meta, rope: q
        if "merge" in skip:
            triton_paged._merge_splits_kernel = _NoLaunch()
        if splits is not None:
            triton_paged.decode_splits = lambda *args, **kwargs: splits
        if "gemm" in skip:

            def no_gemm(x2, weight, bias=None, config=None, act=None):
                width = weight.out_features // (2 if act is not None else 1)
                return x2.new_empty(x2.shape[0], width)

            kbit_dispatch.kbit_matmul_cuda = no_gemm
        if "attn" in skip:
            triton_paged.paged_decode = lambda q, *args, **kwargs: q.new_empty(
                q.shape[0], q.shape[1] * q.shape[2]
            )
        elif extra_ctas is not None:
            decode, empty = triton_paged.paged_decode, _empty_kernel()

            def decode_then_empty(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
                out = decode(q, *args, **kwargs)
                launch = pdl.launch_options(pdl.enabled(q.device))
                empty[(extra_ctas,)](out, num_warps=4, **launch)
                return out

            triton_paged.paged_decode = decode_then_empty
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="the ablation options; every other argument goes to the quantfw command",
        allow_abbrev=False,
    )
    ap.add_argument("--skip", default="", help=f"comma-separated, of: {', '.join(SKIPPABLE)}")
    ap.add_argument("--extra", type=int, default=None, metavar="G")
    ap.add_argument("--splits", type=int, default=None, metavar="N")
    opts, rest = ap.parse_known_args(argv)
    skipped = set(opts.skip.split(",")) - {"none", ""}
    print(
        f"ablation: skip {sorted(skipped)}, extra {opts.extra}, splits {opts.splits}",
        file=sys.stderr,
    )
    with ablated(skipped, opts.extra, opts.splits):
        sys.argv = ["quantfw", *rest]
        runpy.run_module("quantfw.entrypoints.cli", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
