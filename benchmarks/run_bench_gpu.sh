#!/usr/bin/env bash
# `quantfw bench` on the bundled Qwen3-8B config (dummy weights) on one GPU, then with TP=2
# when two GPUs are visible; first the GPU tests of the dummy loader and the bench.
# Run from the repo root on the GPU machine; results go to $OUT (default benchmarks/results).
# Extra arguments are passed to both bench runs (e.g. --max-model-len 40960).
set -euo pipefail
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -c "import torch; assert torch.cuda.is_available(), 'needs a CUDA GPU'"
python -m pytest -q tests/test_dummy_loader.py tests/test_cmd_bench.py 2>&1 | tee "$OUT/bench-gpu-tests.log" \
    || echo "GPU tests FAILED (see $OUT/bench-gpu-tests.log); running the benchmark anyway"
python -m quantfw.entrypoints.cli bench qwen3-8b --methods fp16,awq,gptq,gptq-act,kbit4 \
    --prompt-len 2048 --batch-sizes 1,16 --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/bench-tp1.log"
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    torchrun --nproc-per-node 2 -m quantfw.entrypoints.cli bench qwen3-8b --methods fp16,awq,gptq \
        --prompt-len 2048 --batch-sizes 1,16 --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/bench-tp2.log"
fi
