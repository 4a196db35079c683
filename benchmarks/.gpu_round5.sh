#!/usr/bin/env bash
# round 5: kbit after the split-K epilogue fix (GPU tests, bench, e2e)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kbit_kernels.py tests/quantization/test_kbit_models.py 2>&1 | tail -6 | tee $OUT/kbit-tests.log
timeout 200 python3 benchmarks/bench_kbit.py --out $OUT --ms 1,4,16,1024 --bits 2,4 2>&1 | tail -30 | tee $OUT/kbit-bench.log
timeout 220 python3 -m quantfw.entrypoints.cli bench qwen3-8b --methods fp16,kbit2,kbit4 --batch-sizes 1,16 --prompt-len 2048 --decode-tokens 64 --out-dir $OUT 2>&1 | tail -22 | tee $OUT/kbit-e2e.log
