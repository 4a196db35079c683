"""Attention kernels over the paged KV cache (`triton_paged`: CUDA, imported only when used);
the torch reference lives in `quantfw.layers.attention.backends.sdpa`."""
