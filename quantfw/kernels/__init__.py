"""Pure tensor functions, one folder per method: ``reference`` (slow, obviously correct AWQ /
GPTQ pack/unpack/dequant), ``torch_ops`` (torch's fused int4 ops), ``w4a16/`` (AWQ / GPTQ
4-bit kernels), ``common/`` (config tables, GPU timing)."""
