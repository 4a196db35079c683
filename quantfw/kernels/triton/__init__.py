"""Triton kernels (imported lazily: only when activations are on CUDA)."""
