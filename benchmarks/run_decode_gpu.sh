#!/usr/bin/env bash
# Decode tokens/s with CUDA graphs on and off (and FlashInfer when installed) on one GPU.
# Run from the repo root on the GPU machine; results go to $OUT (default benchmarks/results).
# Fails if greedy tokens differ between the configurations.
set -euo pipefail
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -c "import torch; assert torch.cuda.is_available(), 'needs a CUDA GPU'"
python benchmarks/bench_decode.py --out "$OUT/decode_cuda_graphs.json" "$@"
python -m pytest -q tests/engine/test_cuda_graphs.py
