#!/usr/bin/env bash
# One command for a GPU machine: the gpu-marked MXFP4 / MoE tests, then the layer benchmark
# (GPT-OSS-20B expert shapes, 1..4096 tokens) and the end-to-end GPT-OSS-20B decode benchmark
# (dummy weights, MXFP4 vs bf16 experts). Results land in $OUT (default benchmarks/results).
# Extra arguments go to the layer benchmark (e.g. --sweep, --tokens 1,16,4096).
set -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/mxfp4-gpu-env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/mxfp4-gpu-env.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mxfp4_triton.py tests/moe 2>&1 | tee "$OUT/mxfp4-gpu-tests.log"
test_rc=$?
python3 benchmarks/bench_mxfp4.py --out "$OUT/mxfp4-layer.json" "$@" 2>&1 | tee "$OUT/mxfp4-layer.log"
layer_rc=$?
python3 -m quantfw.entrypoints.cli bench gpt-oss-20b --methods fp16,mxfp4 --dtype bfloat16 \
    --batch-sizes 1,16 --prompt-len 2048 --out-dir "$OUT" 2>&1 | tee "$OUT/mxfp4-e2e.log"
e2e_rc=$?
echo "tests rc=$test_rc layer rc=$layer_rc e2e rc=$e2e_rc"
exit $(( test_rc | layer_rc | e2e_rc ))
