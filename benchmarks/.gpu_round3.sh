#!/usr/bin/env bash
# round 3: MXFP4 LUT GEMV (tests, decode sweep, e2e GPT-OSS-20B)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mxfp4_triton.py 2>&1 | tail -4 | tee $OUT/tests.log
timeout 200 python3 benchmarks/bench_mxfp4.py --out $OUT/layer.json --tokens 1,4,16,4096 --sweep --sweep-tokens 1,4 2>&1 | grep -v "^  skip" | tee $OUT/layer.log
timeout 240 python3 -m quantfw.entrypoints.cli bench gpt-oss-20b --methods fp16,mxfp4 --dtype bfloat16 --batch-sizes 1,16 --prompt-len 2048 --decode-tokens 64 --out-dir $OUT 2>&1 | tail -25 | tee $OUT/e2e.log
