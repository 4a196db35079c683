"""The entry points a method calls: ``repack_weight`` (once, at load) and ``kbit_matmul`` (per
call), each choosing between the Triton kernels and the torch reference by device.

On CUDA (compute capability >= 8.0, Triton installed) the repack runs ``kbit_repack_kernel``
and fp16/bf16 activations run the kbit GEMM kernels (``triton/dispatch.py``, imported on first
CUDA use); otherwise the repack is ``layout.repack`` and the packed weight is dequantized
(``layout.dequantize_weight``) and multiplied in float32.
"""

from __future__ import annotations

import functools

import torch

from quantfw.kernels.common import triton_available
from quantfw.kernels.fused import GatedAct
from quantfw.kernels.kbit import layout
from quantfw.kernels.kbit.layout import KbitWeight, dequantize_weight


@functools.cache
def triton_serves(device: torch.device) -> bool:
    """Whether the Triton kbit kernels can run on `device` (CUDA sm80+ with Triton)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return triton_available()


def repack_weight(
    planes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, name: str = "kbit weight"
) -> KbitWeight:
    """Flat ``planes [N, K/32, bits]``, ``absmax [N, K/32]`` and the codebook -> the field-packed
    `KbitWeight` on the tensors' device."""
    if triton_serves(planes.device):
        from quantfw.kernels.kbit.triton.dispatch import repack

        return repack(planes, absmax, codebook, name)
    return layout.repack(planes, absmax, codebook, name)


def kbit_matmul(
    x: torch.Tensor,
    weight: KbitWeight,
    bias: torch.Tensor | None = None,
    *,
    act: tuple[GatedAct, int] | None = None,
) -> torch.Tensor:
    """out[..., N] = x[..., K] @ W.T (+ bias), in x's dtype. ``act`` (activation, interleave):
    W's rows are a gated pair interleaved in groups (`fused.interleave_gate_up`); returns the
    activation of the output, [..., N / 2] (on the mma kernel, computed in its epilogue)."""
    K = weight.in_features
    if x.shape[-1] != K:
        raise ValueError(f"kbit_matmul: x has {x.shape[-1]} input features, weight has {K}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x.dtype in (torch.float16, torch.bfloat16) and triton_serves(x.device):
        from quantfw.kernels.kbit.triton.dispatch import kbit_matmul_cuda

        out = kbit_matmul_cuda(x2, weight, bias, act=act)
    else:
        out = x2.to(torch.float32) @ dequantize_weight(weight, torch.float32).t()
        if bias is not None:
            out = out + bias.to(torch.float32)
        out = out.to(x.dtype)
        if act is not None:
            out = act[0](out, act[1])
    return out.reshape(*lead, out.shape[-1])
