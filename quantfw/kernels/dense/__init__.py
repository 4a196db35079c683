"""Kernels for unquantized (fp16/bf16) weights where cuBLAS leaves time: the one-token GEMV."""
