#!/usr/bin/env bash
# round 4: kbit field-packed kernels (GPU tests, bench), MoE bf16 routed-alike test
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kbit_kernels.py tests/quantization/test_kbit_models.py 2>&1 | tail -30 | tee $OUT/kbit-tests.log
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/moe/test_moe_models.py -k gpu tests/engine/test_triton_attention_gpu.py::test_fused_ops_match_reference_on_gpu 2>&1 | tail -8 | tee $OUT/moe-tests.log
timeout 220 python3 benchmarks/bench_kbit.py --out $OUT --ms 1,16,1024 --bits 2,4 2>&1 | tail -40 | tee $OUT/kbit-bench.log
