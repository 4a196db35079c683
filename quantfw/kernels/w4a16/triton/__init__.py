"""W4A16 GPU kernels, dispatch and tuning (imported only when activations are on CUDA)."""
