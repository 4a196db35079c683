#!/usr/bin/env bash
# Nsight Compute reports of single kernel launches (benchmarks/ncu_kernels.py) on a GPU machine:
#   bash benchmarks/run_ncu.sh NAME KERNEL_REGEX METHOD [ncu_kernels.py args...]
# writes $OUT/NAME.ncu-rep, NAME.txt (every section) and NAME-sass.csv (per-instruction
# counters and stall samples).
set -o pipefail
OUT=${OUT:-benchmarks/results}
n=$1 r=$2
shift 2
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
   --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats
   --section ComputeWorkloadAnalysis --section SourceCounters"
ncu --clock-control none -k "regex:$r" --launch-skip 2 --launch-count 1 $S -o "$OUT/$n" \
    python3 benchmarks/ncu_kernels.py "$@" > "$OUT/$n.log" 2>&1
ncu --import "$OUT/$n.ncu-rep" --print-details all > "$OUT/$n.txt" 2>&1
ncu --import "$OUT/$n.ncu-rep" --page source --print-source sass --csv > "$OUT/$n-sass.csv" 2>&1
grep -E "Duration|DRAM Throughput|L1/TEX Cache|Registers Per|Achieved Occ|Issued Warp Per|Grid Size" \
    "$OUT/$n.txt" | head -12
