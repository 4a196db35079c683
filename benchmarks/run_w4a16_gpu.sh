#!/usr/bin/env bash
# One command for a GPU machine: the gpu-marked W4A16 tests, then the benchmark.
# Results (test log, json/md/png) land in $OUT (default benchmarks/results).
set -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/w4a16-gpu-env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/w4a16-gpu-env.txt"
python3 -m pytest -q -m gpu tests/kernels/test_w4a16.py -x -p no:cacheprovider 2>&1 | tee "$OUT/w4a16-gpu-tests.log"
test_rc=$?
python3 benchmarks/bench_w4a16.py --out "$OUT" "$@" 2>&1 | tee "$OUT/w4a16-bench.log"
bench_rc=$?
echo "tests rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc | bench_rc ))
