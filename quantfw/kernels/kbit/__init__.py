"""kbit (K = 2..5 bit codebook quantization, blocks of 32, E4M4 scales, bit planes) kernels.

``format`` (codebooks, E4M4, bit planes, reference quantize / dequantize), ``layout`` (the
field-packed GEMM layout, reference repack, CPU twin), ``ops`` (``repack_weight`` and
``kbit_matmul``: the entry points, dispatching by device), ``configs`` and ``tables`` (kernel
configs; no Triton), ``triton/`` (GPU repack, fused and dequantize kernels, dispatch,
tuning; imported only on CUDA). Format: docs/formats.md; kernels: docs/kernels-kbit.md.
"""

from quantfw.kernels.kbit.format import (
    BLOCKSIZE,
    SUPPORTED_BITS,
    check_codebook,
    decode_e4m4,
    dequantize,
    encode_e4m4,
    normal_float_codebook,
    quantize,
)
from quantfw.kernels.kbit.layout import (
    GATED_GROUP,
    KbitWeight,
    dequantize_weight,
    repack,
    tiled_nbytes,
    unpack,
)
from quantfw.kernels.kbit.ops import kbit_matmul, repack_weight

__all__ = [
    "BLOCKSIZE",
    "GATED_GROUP",
    "SUPPORTED_BITS",
    "KbitWeight",
    "check_codebook",
    "decode_e4m4",
    "dequantize",
    "dequantize_weight",
    "encode_e4m4",
    "kbit_matmul",
    "normal_float_codebook",
    "quantize",
    "repack",
    "repack_weight",
    "tiled_nbytes",
    "unpack",
]
