#!/usr/bin/env bash
# round 2: MXFP4 GEMV / dequant paths (tests, layer bench + sweep, e2e GPT-OSS-20B)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/env.txt
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mxfp4_triton.py tests/moe 2>&1 | tail -15 | tee $OUT/tests.log
timeout 240 python3 benchmarks/bench_mxfp4.py --out $OUT/layer.json --tokens 1,4,16,64,256,1024,4096 --sweep --sweep-tokens 1,4096 2>&1 | grep -v "^  skip" | tee $OUT/layer.log
timeout 200 python3 -m quantfw.entrypoints.cli bench gpt-oss-20b --methods fp16,mxfp4 --dtype bfloat16 --batch-sizes 1 --prompt-len 512 --decode-tokens 64 --out-dir $OUT 2>&1 | tail -40 | tee $OUT/e2e.log
