"""What the lookup kernel's main loop issues, and what a one-token GEMM needs of the SMs' issue
slots to stream at its bandwidth floor: no GPU needed (sm_90 compiles through Triton's bundled
ptxas and nvdisasm, as the CPU tests compile).

For each one-token default of `kbit_mma_kernel` (kbit K = 2..5, and MXFP4's grouped bf16 launch
with W13's SwiGLU; and the 16-token tile at K = 2, 4, unstaged and staged under its register
cap): registers, shared memory, the SASS
instructions of the loop body (one iteration: each warp one chunk of 4 blocks x 64 columns, 8192
weights, 32 `HMMA` a tile of 8 tokens) by opcode, and the share of the GPU's peak issue rate (SMs x
4 schedulers x clock, one warp instruction a cycle each) that those instructions take when the
weights stream at the given bandwidth. A share near or above 1 is a bound no schedule beats (K = 3
and 5 at the H200's bandwidth); below it the time is set by latency at the kernel's occupancy, and
fewer instructions need not help (benchmarks/kbit-lab-log.md §25: 7% fewer at K = 2 lost 4% end to
end).

Two pipes bound the loop before issue does, so their shares at the floor are given too:

* integer: sm_90 runs 32-bit integer and logic instructions (`INT_OPS`: the lookups' PRMT, LOP3,
  SHF, IMAD, ...) at 64 lanes a cycle an SM, two warp instructions a cycle against the four
  schedulers' four (the CUDA C++ Programming Guide's throughput table), so a decode moved from
  the table into registers costs twice its count (kbit-lab-log §35: +15% instructions, 0.68-0.82x);
* shared memory: one wavefront (128 bytes) a cycle an SM; a warp's `LDS` of 4, 8 or 16 bytes a
  lane takes 1, 2 or 4 wavefronts when conflict-free (the table's copies make it so), counted
  as if broadcasts (K = 2's lanes c and c + 1 read one word) saved none (not measured). The TMA
  writes into the slots (a quarter to half a wavefront a warp's LDS.128) are left out.

    python benchmarks/sass_mma_loop.py                     # H200: 4.25 TB/s, 132 SMs, 1.98 GHz
    python benchmarks/sass_mma_loop.py --bandwidth 3.0     # H100 SXM
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [
    os.path.join(HERE, "..", "tests", "support"),
    os.path.join(HERE, "..", "tests", "kernels"),
]

WEIGHTS_PER_ITERATION = 4 * 32 * 64  # a warp's chunk: 4 blocks of 32 inputs x 64 columns
#: opcodes that run on sm_90's 32-bit integer pipes (64 lanes a cycle an SM)
INT_OPS = frozenset(
    [
        "IMAD",
        "IADD3",
        "LOP3",
        "SHF",
        "PRMT",
        "LEA",
        "ISETP",
        "SGXT",
        "VIMNMX",
        "IMNMX",
        "SEL",
        "IABS",
        "BMSK",
        "FLO",
        "POPC",
    ]
)
#: shared-memory wavefronts of a conflict-free warp load, by width suffix
LDS_WAVEFRONTS = {"": 1, ".U8": 1, ".S8": 1, ".U16": 1, ".S16": 1, ".64": 2, ".128": 4}


def variants() -> list[tuple[str, int, dict]]:
    """(name, bits, constexprs) of the one-token defaults (`configs._mma_default`, 8-token
    tiles, 4 warps on one column block, TMA staging where `mma.tma_staging` turns it on)."""
    base = dict(W=4, CH=4, TM=8, PIPE=False, MASK_N=False, MASK_K=False, HAS_BIAS=False,
                IS_BF16=False, UE8M0=False, GROUPED=False, GATHER=False, PDL=True, WK=4,
                LATE_RELEASE=False)  # fmt: skip
    from quantfw.kernels.kbit import configs
    from quantfw.kernels.kbit.triton import mma as KM

    out = []
    for bits in (2, 3, 4, 5):
        copies = configs.default_config(1, 0, 0, bits)[4]  # the default's table copies
        for split, act, name in ((2, 0, "split K"), (1, 1, "gate_up + SiLU")):
            consts = {**base, "SPLIT": split, "ACT": act, "COPIES": copies, "BITS": bits,
                      "TMA": bits != 3}  # fmt: skip
            out.append((f"kbit K={bits} {name}", bits, consts))
    mx = {**base, "SPLIT": 1, "ACT": 2, "COPIES": 32, "BITS": 4, "TMA": True, "MASK_K": True,
          "HAS_BIAS": True, "IS_BF16": True, "UE8M0": True, "GROUPED": True, "GATHER": True}  # fmt: skip
    out.append(("MXFP4 W13 grouped + SwiGLU", 4, mx))
    for bits in (2, 4):  # the 16-token tile, unstaged and where `mma.staged_tile16` stages it
        copies = configs.default_config(16, 0, 0, bits)[4]
        tile16 = {**base, "TM": 16, "SPLIT": 2, "ACT": 0, "COPIES": copies, "BITS": bits,
                  "TMA": False, "PAIR": KM.pairs_columns(bits, 16)}  # fmt: skip
        out.append((f"kbit K={bits} 16-token split K", bits, tile16))
        staged = {**tile16, "TMA": True, "MAXNREG": KM.TILE16_STAGED_MAXNREG}
        out.append((f"kbit K={bits} 16-token staged", bits, staged))
    return out


def compile_variant(bits: int, consts: dict) -> tuple[str, int, int]:
    """(SASS text, registers, shared bytes) of one sm_90 compile (``MAXNREG`` in `consts`: a
    register cap)."""
    from aot import compile_for_sm90, resource_usage, sass
    from test_kbit_kernels import _MMA_ALIGNED, _MMA_SIGNATURE, _mma_tma_signature

    from quantfw.kernels.kbit.triton import mma as KM

    sig = _mma_tma_signature(bits) if consts["TMA"] else dict(_MMA_SIGNATURE)
    if consts["IS_BF16"]:
        sig.update(bias_ptr="*bf16", out_ptr="*bf16")
    if consts["TMA"]:
        # Qwen3-8B's K: whole 16-byte scale rows, staged in dense launches (not grouped ones)
        consts = {**consts, "S_TMA": not consts["GROUPED"]}
    else:
        consts = {**consts, "w_desc": None, "o_desc": None, "s_desc": None}
    cap = consts.pop("MAXNREG", None)
    options = {} if cap is None else {"maxnreg": cap}
    kernel = compile_for_sm90(
        KM.kbit_mma_kernel,
        sig,
        consts,
        aligned=_MMA_ALIGNED,
        num_warps=4,
        launch_pdl=True,
        **options,
    )
    regs = int(re.search(r"REG:(\d+)", resource_usage(kernel)).group(1))
    return sass(kernel), regs, kernel.metadata.shared


def loop_body(sass: str) -> list[str]:
    """The instructions of the main loop: the backward branch whose span holds the most `HMMA`
    (mbarrier retry loops and the code after `EXIT` left out)."""
    labels = {m.group(1): m.start() for m in re.finditer(r"(\.L_x_\d+):", sass)}
    best = (-1, "")
    for m in re.finditer(r"BRA[^\n]*?(\.L_x_\d+)", sass):
        start = labels.get(m.group(1))
        if start is None or start >= m.start() or "EXIT" in sass[start : m.start()]:
            continue
        span = sass[start : m.start()]
        best = max(best, (span.count("HMMA"), span))
    return [ln for ln in best[1].splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]


def opcode(line: str) -> str:
    m = re.search(r"\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)", line)
    return m.group(1) if m else "?"


def shared_wavefronts(body: list[str]) -> int:
    """Wavefronts of the loop's shared-memory loads, each conflict-free (`LDS_WAVEFRONTS`)."""
    total = 0
    for line in body:
        m = re.search(r"\bLDS((?:\.U8|\.S8|\.U16|\.S16|\.64|\.128)?)\b", line)
        if m and opcode(line) == "LDS":
            total += LDS_WAVEFRONTS[m.group(1)]
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidth", type=float, default=4.25, help="TB/s the weights stream at")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--clock", type=float, default=1.98, help="SM clock, GHz")
    args = ap.parse_args()
    peak = args.sms * 4 * args.clock * 1e9  # warp instructions a second
    print(f"{args.sms} SMs x 4 schedulers x {args.clock} GHz; weights at {args.bandwidth} TB/s")
    for name, bits, consts in variants():
        sass, regs, smem = compile_variant(bits, consts)
        body = loop_body(sass)
        ops = collections.Counter(opcode(ln) for ln in body)
        # one chunk of 8192 weights a warp: 32 `HMMA` an 8-token tile
        assert ops["HMMA"] == 32 * consts["TM"] // 8, (name, ops["HMMA"])
        bytes_per_weight = bits / 8 + 1 / 32  # fields and one scale byte per block of 32
        weights_per_s = args.bandwidth * 1e12 / bytes_per_weight
        per_s = weights_per_s / WEIGHTS_PER_ITERATION  # warp chunks a second
        share = per_s * len(body) / peak
        ints = sum(n for op, n in ops.items() if op in INT_OPS)
        int_share = per_s * ints / (peak / 2)  # two integer warp instructions a cycle an SM
        waves = shared_wavefronts(body)
        lds_share = per_s * waves / (peak / 4)  # one wavefront a cycle an SM
        mix = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
        print(f"{name:28s} {regs:3d} regs {smem // 1024:3d} KB  loop {len(body):5d} instr "
              f"({len(body) * 32 / WEIGHTS_PER_ITERATION:.2f} a weight a thread)  issue share "
              f"at the floor {share:.2f}, integer pipe {int_share:.2f} ({ints}), shared "
              f"wavefronts {lds_share:.2f} ({waves})  [{mix}]")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
