#!/usr/bin/env bash
# One command for a GPU machine: the gpu-marked MXFP4 / MoE tests, then the layer benchmark
# (GPT-OSS-20B expert shapes, 1..4096 tokens), the end-to-end GPT-OSS-20B decode benchmark
# (dummy weights, MXFP4 vs bf16 experts) and the decode-step profile. Results land in $OUT
# (default benchmarks/results). Extra arguments go to the layer benchmark (e.g. --sweep).
set -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/mxfp4-gpu-env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/mxfp4-gpu-env.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mxfp4_triton.py tests/moe 2>&1 | tail -30 > "$OUT/mxfp4-gpu-tests.log"
test_rc=$?
tail -3 "$OUT/mxfp4-gpu-tests.log"
python3 benchmarks/bench_mxfp4.py --out "$OUT/mxfp4-layer.json" "$@" > "$OUT/mxfp4-layer.log" 2>&1
layer_rc=$?
python3 -m quantfw.entrypoints.cli bench gpt-oss-20b --methods fp16,mxfp4 --dtype bfloat16 \
    --batch-sizes 1,16 --prompt-len 2048 --out-dir "$OUT" > "$OUT/mxfp4-e2e.log" 2>&1
e2e_rc=$?
tail -6 "$OUT/mxfp4-e2e.log"
python3 benchmarks/profile_gpt_oss.py --batch-sizes 1,16 --out "$OUT/profile-gpt-oss-20b.json" \
    > "$OUT/profile-gpt-oss-20b.log" 2>&1
echo "tests rc=$test_rc layer rc=$layer_rc e2e rc=$e2e_rc"
exit $(( test_rc | layer_rc | e2e_rc ))
