#!/usr/bin/env bash
# round 1: MXFP4 kernel rewrite (tests, layer bench with sweep, e2e GPT-OSS-20B)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/env.txt
timeout 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernels/test_mxfp4_triton.py 2>&1 | tail -15 | tee $OUT/tests.log
timeout 300 python3 benchmarks/bench_mxfp4.py --out $OUT/layer.json --tokens 1,4,16,64,256,1024,4096 --sweep --sweep-tokens 1,4096 2>&1 | grep -v "^  skip" | tee $OUT/layer.log
