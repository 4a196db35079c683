#!/usr/bin/env bash
# One command for a GPU machine: the gpu-marked kbit tests, then the kbit benchmark.
# Results (test log, json/md/png, tuned table) land in $OUT (default benchmarks/results).
# Extra arguments go to the benchmark (e.g. --bits 2,4 --shapes qwen3-8b.gate_up).
set -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/kbit-gpu-env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/kbit-gpu-env.txt"
python3 -m pytest -q -m gpu tests/kernels/test_kbit_kernels.py tests/quantization/test_kbit_models.py -x -p no:cacheprovider 2>&1 | tee "$OUT/kbit-gpu-tests.log"
test_rc=$?
python3 benchmarks/bench_kbit.py --out "$OUT" --configs-out "$OUT/kbit-tuned" "$@" 2>&1 | tee "$OUT/kbit-bench.log"
bench_rc=$?
echo "tests rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc | bench_rc ))
