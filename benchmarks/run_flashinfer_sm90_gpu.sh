#!/usr/bin/env bash
# FlashInfer's SM90 fused MoE as quantfw's MXFP4 expert backend, on a GPU machine without
# network: FlashInfer's Python package (trimmed: no sources), its tvm-ffi runtime and small
# dependencies come as files in .carry/ (benchmarks/build_flashinfer_sm90_moe.py builds them on
# a CPU machine, with the module `fused_moe_90.so` holding only the bf16 x MXFP4 kernels), and
# the module is installed where FlashInfer looks for a prebuilt one, so nothing is compiled here.
#   bash benchmarks/run_flashinfer_sm90_gpu.sh smoke|tests|layer|e2e ...   (results in $OUT)
set -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
FI=/tmp/quantfw-flashinfer
if [ ! -d "$FI/flashinfer" ]; then
    mkdir -p "$FI" && tar -C "$FI" -xJf .carry/fi-trim.tar.xz
    python3 -m pip install -q --no-index --no-deps --target "$FI" .carry/wheels/*.whl
    mkdir -p "$FI/flashinfer/data/aot/fused_moe_90"
    cp .carry/fused_moe_90.so "$FI/flashinfer/data/aot/fused_moe_90/"
fi
TORCH_LIB=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")/../nvidia/cu13/lib
export PYTHONPATH=$FI:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export LD_LIBRARY_PATH=$TORCH_LIB:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FLASHINFER_WORKSPACE_BASE=/tmp/quantfw-flashinfer-ws
rc=0
for step in "$@"; do
    case $step in
    smoke)
        python3 - <<'EOF' 2>&1 | tee "$OUT/flashinfer-sm90-smoke.log" || rc=1
import time, torch, flashinfer
from flashinfer.fused_moe.core import get_cutlass_fused_moe_module
t = time.time()
get_cutlass_fused_moe_module("90")
print(torch.cuda.get_device_name(), "flashinfer", flashinfer.__version__,
      f"module loaded in {time.time() - t:.1f} s (prebuilt: no compile)")
EOF
        ;;
    tests)
        python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mxfp4_flashinfer_sm90.py \
            tests/moe/test_moe_models.py -k "flashinfer" 2>&1 | tail -30 \
            | tee "$OUT/flashinfer-sm90-gpu-tests.log" || rc=1
        ;;
    layer)
        python3 benchmarks/bench_mxfp4.py --flashinfer --tokens 1,2,4,8,16,64,256,1024,4096 \
            --out "$OUT/mxfp4-layer-flashinfer.json" 2>&1 | tee "$OUT/mxfp4-layer-flashinfer.log" || rc=1
        ;;
    e2e)
        python3 -m quantfw.entrypoints.cli bench gpt-oss-20b \
            --methods fp16,mxfp4,mxfp4-flashinfer --dtype bfloat16 --batch-sizes 1,16 \
            --prompt-len 2048 --out-dir "$OUT" 2>&1 | tee "$OUT/flashinfer-sm90-e2e.log" | tail -12 || rc=1
        ;;
    *) echo "unknown step $step" && rc=1 ;;
    esac
done
exit $rc
