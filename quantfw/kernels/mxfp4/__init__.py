"""MXFP4 (FP4 E2M1 values, UE8M0 scales per 32) weights.

``format`` (the bytes: decode, encode; the reference), ``moe`` (the mixture-of-experts path:
token sort by expert, grouped GEMMs on the CPU one expert at a time, and the dispatch to the
GPU kernels), ``triton/`` (grouped MXFP4 x bf16/fp16 GEMM for CUDA GPUs; imported only for CUDA
tensors), ``flashinfer_layout`` / ``flashinfer`` (Blackwell: FlashInfer's grouped MXFP4 GEMM,
its layout rules as pure functions and the call).
"""

from quantfw.kernels.mxfp4.format import (
    BLOCK_SIZE,
    FP4_VALUES,
    SCALE_BIAS,
    check_blocks,
    dequantize,
    pack_codes,
    quantize,
    unpack_codes,
)

__all__ = [
    "BLOCK_SIZE",
    "FP4_VALUES",
    "SCALE_BIAS",
    "check_blocks",
    "dequantize",
    "pack_codes",
    "quantize",
    "unpack_codes",
]
