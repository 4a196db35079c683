"""kbit GPU kernels (plain Triton), dispatch and tuning (imported only on CUDA)."""
