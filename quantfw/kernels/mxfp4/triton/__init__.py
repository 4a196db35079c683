"""Triton kernels for MXFP4 (and dense) expert weights on CUDA GPUs; imported on first CUDA use
(`quantfw.kernels.mxfp4.grouped` dispatches)."""
