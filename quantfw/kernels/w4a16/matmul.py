"""``w4a16_matmul``: the per-call entry point over a `PackedW4` weight.

CUDA activations run the Triton kernels (``triton/dispatch.py``, imported on first CUDA call);
CPU activations dequantize the packed layout (``layout.dequantize_packed``) and multiply in
float32.
"""

from __future__ import annotations

import torch

from quantfw.kernels.w4a16.layout import PackedW4, dequantize_packed


def w4a16_matmul(
    x: torch.Tensor, packed: PackedW4, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """out[..., N] = x[..., K] @ W (+ bias), in x's dtype (fp16 or bf16 on CUDA)."""
    K, N = packed.in_features, packed.out_features
    if x.shape[-1] != K:
        raise ValueError(f"w4a16_matmul: x has {x.shape[-1]} input features, weight has {K}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)
    if x.is_cuda:
        from quantfw.kernels.w4a16.triton.dispatch import w4a16_matmul_cuda

        out = w4a16_matmul_cuda(x2.contiguous(), packed, bias)
    else:
        out = x2.to(torch.float32) @ dequantize_packed(packed, torch.float32)
        if bias is not None:
            out = out + bias.to(torch.float32)
        out = out.to(x.dtype)
    return out.reshape(*lead, N)
