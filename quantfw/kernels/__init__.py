"""Pure tensor functions: reference dequantization, torch fused int4 ops, Triton W4A16 kernels."""
