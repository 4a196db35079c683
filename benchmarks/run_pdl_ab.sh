#!/usr/bin/env bash
# Programmatic dependent launch on and off, side by side on one GPU: `quantfw bench MODEL
# --methods METHODS` with QUANTFW_PDL=1, then QUANTFW_PDL=0 (quantfw/kernels/common/pdl.py).
# Usage (repo root, GPU machine): benchmarks/run_pdl_ab.sh MODEL METHODS [bench arguments]
# Results: $OUT/pdl-on and $OUT/pdl-off (default OUT=benchmarks/results).
set -euo pipefail
OUT="${OUT:-benchmarks/results}"
model=$1
methods=$2
shift 2
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for mode in on off; do
    flag=1
    [ "$mode" = off ] && flag=0
    mkdir -p "$OUT/pdl-$mode"
    QUANTFW_PDL=$flag python -m quantfw.entrypoints.cli bench "$model" --methods "$methods" \
        --out-dir "$OUT/pdl-$mode" "$@" 2>&1 | tee "$OUT/pdl-$mode/$model.log"
done
