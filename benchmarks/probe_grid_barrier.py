"""GPU probe: what a dependent GEMV boundary costs as a kernel launch with PDL against a grid
barrier inside one persistent kernel (decode-lab-log experiment 18).

A chain of ``S`` one-token GEMVs, ``x_{s+1} = W_s x_s`` (fp16 ``[D, D]`` weights, float32
sums, fp16 vectors), where every output needs every input, as a decode step's GEMMs do. Both
variants run the same per-CTA code: load the CTA's ``ROWS`` weight rows (they depend on no
earlier stage), wait for the stage's input, read it, reduce, store.

* ``launches``: one kernel a stage, launched with PDL (the next stage's CTAs start and load
  their weights while this one finishes; `common.pdl`), as quantfw's decode step runs;
* ``persistent``: one kernel of co-resident CTAs looping over the stages; between stages each
  CTA bumps the stage's arrival counter and spins until every CTA has arrived (the last CTA
  of the last stage resets the counters, so CUDA-graph replays need no memset).

And two that keep the weights streaming across a boundary (decode-lab-log experiment 21):

* ``launches + L2``: as ``launches``, and before its PDL wait each CTA asks L2 for its rows of
  the *next* stage (one ``cp.async.bulk.prefetch.L2``), so that stage's loads hit L2;
* ``persistent, one ahead``: as ``persistent``, but each CTA issues its rows of stage s + 1
  before it waits at stage s's barrier and computes stage s, so a stage's weights are in
  flight during the stage before it (two stages of rows in registers).

Each chain is timed as CUDA-graph replays (`common.timing`); the weights of all stages exceed
L2. ``(launches - persistent) / (S - 1)`` is what a persistent kernel would save per
boundary. The result is checked against a float32 reference of the chain.

    python benchmarks/probe_grid_barrier.py [--dim 2048] [--stages 16] [--rows 8]
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from quantfw.bench.measure import measure_copy_bandwidth
from quantfw.kernels.common import pdl, timing


@triton.jit
def _stage_rows(x_ptr, y_ptr, row0, D, w, ROWS: tl.constexpr, DP: tl.constexpr, X_CG: tl.constexpr):
    """y[row0 : row0 + ROWS] = w @ x for the CTA's loaded weight rows ``w`` [ROWS, DP]; x read
    past L1 when other CTAs of this kernel wrote it (``X_CG``)."""
    k = tl.arange(0, DP)
    if X_CG:
        x = tl.load(x_ptr + k, mask=k < D, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(x_ptr + k, mask=k < D, other=0.0)
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    rows = row0 + tl.arange(0, ROWS)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < D)


@triton.jit
def _load_rows(w_ptr, row0, D, ROWS: tl.constexpr, DP: tl.constexpr, valid=True):
    rows = row0 + tl.arange(0, ROWS)
    k = tl.arange(0, DP)
    mask = (rows < D)[:, None] & (k < D)[None, :] & valid
    return tl.load(w_ptr + rows[:, None] * D + k[None, :], mask=mask, other=0.0)


#: PTX: thread 0 asks L2 for $2 bytes from $1 (sm_90 bulk prefetch, no data returned)
_L2_PREFETCH_ASM = tl.constexpr(
    "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;"
    " @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)


@triton.jit
def _stage_kernel(
    w_ptr, x_ptr, y_ptr, next_ptr, D, ROWS: tl.constexpr, DP: tl.constexpr, PDL: tl.constexpr,
    L2_NEXT: tl.constexpr,
):  # fmt: skip
    """One stage, one launch: weights first (``L2_NEXT``: and an L2 prefetch of the CTA's rows
    of the next stage at ``next_ptr``), then the PDL wait, then x."""
    pdl.triton_release(PDL)
    row0 = tl.program_id(0) * ROWS
    w = _load_rows(w_ptr, row0, D, ROWS, DP)
    if L2_NEXT:
        at = next_ptr + row0 * D + tl.zeros([1], tl.int32)
        nbytes = tl.minimum(ROWS, D - row0) * D * 2 + tl.zeros([1], tl.int32)
        tl.inline_asm_elementwise(
            _L2_PREFETCH_ASM, "=r,l,r", [at, nbytes], dtype=tl.int32, is_pure=False, pack=1
        )
    pdl.triton_wait(PDL)
    _stage_rows(x_ptr, y_ptr, row0, D, w, ROWS, DP, False)


@triton.jit
def _chain_kernel(
    w_ptr, buf_ptr, cnt_ptr, D, S, ROWS: tl.constexpr, DP: tl.constexpr, AHEAD: tl.constexpr
):  # fmt: skip
    """Every stage in one launch: stage s reads ``buf[s]`` and writes ``buf[s + 1]``; the CTAs
    (all resident: the grid is at most what fits at once) meet at counter s between stages.
    ``AHEAD``: the CTA's rows of stage s + 1 are loaded before it waits for stage s - 1."""
    nctas = tl.num_programs(0)
    row0 = tl.program_id(0) * ROWS
    w = _load_rows(w_ptr, row0, D, ROWS, DP)
    for s in range(S):
        if AHEAD:
            w_next = _load_rows(w_ptr + (s + 1) * D * D, row0, D, ROWS, DP, s + 1 < S)
        elif s > 0:
            w = _load_rows(w_ptr + s * D * D, row0, D, ROWS, DP)
        if s > 0:
            seen = tl.atomic_add(cnt_ptr + s - 1, 0, sem="acquire")
            while seen < nctas:
                seen = tl.atomic_add(cnt_ptr + s - 1, 0, sem="acquire")
        _stage_rows(buf_ptr + s * D, buf_ptr + (s + 1) * D, row0, D, w, ROWS, DP, True)
        tl.debug_barrier()  # every thread's stores before the CTA's arrival
        ticket = tl.atomic_add(cnt_ptr + s, 1, sem="release")
        if (s == S - 1) & (ticket == nctas - 1):
            # every CTA has passed every wait: clean counters for the next replay
            for t in range(S):
                tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed")
        if AHEAD:
            w = w_next


def chain_launches(
    weights: torch.Tensor, bufs: torch.Tensor, rows: int, l2_next: bool = False
) -> torch.Tensor:
    """The chain as one PDL launch a stage (``l2_next``: each prefetching the next stage's
    rows into L2 before its wait); returns the last vector."""
    S, D, _ = weights.shape
    grid = (triton.cdiv(D, rows),)
    for s in range(S):
        _stage_kernel[grid](
            weights[s], bufs[s], bufs[s + 1], weights[min(s + 1, S - 1)], D, ROWS=rows,
            DP=triton.next_power_of_2(D), L2_NEXT=l2_next and s + 1 < S, num_warps=4,
            **pdl.launch_options(pdl.enabled(weights.device)),
        )  # fmt: skip
    return bufs[S]


def chain_persistent(
    weights: torch.Tensor, bufs: torch.Tensor, counters: torch.Tensor, rows: int,
    ahead: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The chain as one launch of co-resident CTAs with a grid barrier between stages
    (``ahead``: each stage's rows loaded during the stage before); the caller checks that ``D
    / rows`` CTAs fit at once (`resident_ctas`), or it never ends."""
    S, D, _ = weights.shape
    _chain_kernel[(triton.cdiv(D, rows),)](
        weights, bufs, counters, D, S, ROWS=rows, DP=triton.next_power_of_2(D), AHEAD=ahead,
        num_warps=4,
    )  # fmt: skip
    return bufs[S]


def resident_ctas(
    weights: torch.Tensor, bufs: torch.Tensor, counters: torch.Tensor, rows: int,
    ahead: bool = False,
) -> int:  # fmt: skip
    """How many CTAs of the persistent kernel fit on the GPU at once, from its compiled
    registers and shared memory (4 warps a CTA)."""
    S, D, _ = weights.shape
    kernel = _chain_kernel.warmup(
        weights, bufs, counters, D, S, ROWS=rows, DP=triton.next_power_of_2(D), AHEAD=ahead,
        num_warps=4, grid=(1,),
    )  # fmt: skip
    kernel._init_handles()
    props = torch.cuda.get_device_properties(weights.device)
    threads = 4 * 32
    regs = -(-max(kernel.n_regs, 1) // 8) * 8 * threads  # allocated in units of 8 a thread
    by_regs = props.regs_per_multiprocessor // regs
    by_threads = props.max_threads_per_multi_processor // threads
    by_smem = props.shared_memory_per_multiprocessor // max(kernel.metadata.shared, 1)
    return min(by_regs, by_threads, by_smem) * props.multi_processor_count


def reference(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The chain in float32 with each stage's output rounded to the vectors' dtype."""
    for w in weights:
        x = (w.float() @ x.float()).to(x.dtype)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8, help="weight rows a CTA")
    args = ap.parse_args()
    D, S, rows = args.dim, args.stages, args.rows
    if rows < 1 or rows & (rows - 1):
        raise SystemExit(f"--rows {rows}: the weight rows a CTA must be a power of two")
    dev = torch.device("cuda")
    ctas = triton.cdiv(D, rows)
    g = torch.Generator(device=dev).manual_seed(0)
    weights = (torch.randn(S, D, D, device=dev, generator=g) / D**0.5).half()
    x = torch.randn(D, device=dev, generator=g).half()
    counters = torch.zeros(S, device=dev, dtype=torch.int32)
    bufs = torch.full((S + 1, D), float("nan"), device=dev, dtype=torch.half)
    for ahead in (False, True):
        fit = resident_ctas(weights, bufs, counters, rows, ahead)
        if ctas > fit:
            raise SystemExit(
                f"{ctas} CTAs of {rows} rows, but only {fit} fit at once (ahead={ahead}): the "
                "persistent kernel needs every CTA resident (raise --rows)"
            )
    chains = {
        "launches (PDL)": lambda b: chain_launches(weights, b, rows),
        "launches + L2 next": lambda b: chain_launches(weights, b, rows, l2_next=True),
        "persistent": lambda b: chain_persistent(weights, b, counters, rows),
        "persistent, one ahead": lambda b: chain_persistent(weights, b, counters, rows, True),
    }
    want = reference(weights, x).float()
    buffers = {}
    for name, chain in chains.items():
        b = buffers[name] = bufs.clone()
        b[0] = x
        got = chain(b)
        torch.cuda.synchronize()
        err = ((got.float() - want).norm() / want.norm()).item()
        print(f"{name}: relative error {err:.2e} against the float32 reference")
        if not err < 1e-2 or not torch.isfinite(got).all():
            raise SystemExit(f"{name}: wrong result")
        assert int(counters.sum()) == 0, f"{name}: the persistent kernel left its counters set"
    nbytes = weights.numel() * weights.element_size()
    est = nbytes / 3e12 * 1e6
    times = timing.graph_times(
        [[functools.partial(chain, buffers[name])] for name, chain in chains.items()], est
    )
    bw = measure_copy_bandwidth(dev)
    floor = nbytes / bw * 1e6
    print(
        f"{torch.cuda.get_device_name(dev)}: {S} stages of [{D}, {D}] fp16 ({nbytes / 2**20:.0f} "
        f"MiB), {ctas} CTAs of {rows} rows; floor {floor:.1f} us ({floor / S:.2f} a stage) at "
        f"{bw / 1e12:.2f} TB/s"
    )
    for name, t in zip(chains, times, strict=True):
        print(f"{name:22s} {t:8.1f} us  {t / S:6.2f} us a stage  {t / floor:5.2f}x the floor")
    t_l, t_p = times[0], times[2]
    print(f"persistent saved a boundary {(t_l - t_p) / (S - 1):6.2f} us")


if __name__ == "__main__":
    main()
