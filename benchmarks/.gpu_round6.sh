#!/usr/bin/env bash
# round 6: kbit gather for every K + stages-1 defaults; e2e kbit and GPT-OSS MXFP4 with new defaults
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p $OUT/kb $OUT/q3 $OUT/go
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kbit_kernels.py tests/quantization/test_kbit_models.py 2>&1 | tail -4 > $OUT/kbit-tests.log; cat $OUT/kbit-tests.log
timeout 150 python3 benchmarks/bench_kbit.py --out $OUT/kb --ms 1,16,1024 --bits 2,4 2>&1 | grep -v tuning | tail -22
timeout 150 python3 -m quantfw.entrypoints.cli bench qwen3-8b --methods fp16,kbit2,kbit4 --batch-sizes 1 --prompt-len 2048 --decode-tokens 64 --out-dir $OUT/q3 2>&1 | tail -12
timeout 170 python3 -m quantfw.entrypoints.cli bench gpt-oss-20b --methods fp16,mxfp4 --dtype bfloat16 --batch-sizes 1,16 --prompt-len 2048 --decode-tokens 64 --out-dir $OUT/go 2>&1 | tail -12
