"""What AWQ and GPTQ share: shard checks in create_weights and the 4-bit runtimes.

Runtime per device, chosen once in process_weights_after_loading:

* CUDA (compute capability >= 8.0) with fp16/bf16 activations: our Triton W4A16 kernels
  (`quantfw.kernels.w4a16`, layout in docs/kernels-w4a16.md);
* CPU (and CUDA in float32): torch's fused int4pack ops (`quantfw.kernels.torch_ops`);
* otherwise: dequantize on every call (the methods' own fallback).
"""

from __future__ import annotations

import torch
from torch import nn

from quantfw.kernels import torch_ops, w4a16


def check_divisible(layer: nn.Module, what: str, size: int, divisor: int, why: str) -> None:
    """Raise a clear error when a per-rank size would split a group or a packed int32."""
    if size % divisor:
        tp = getattr(layer, "tp_size", 1)
        raise ValueError(
            f"layer {getattr(layer, 'prefix', '') or '(root)'}: {what} {size} (tensor_parallel_size "
            f"{tp}) is not a multiple of {divisor}: {why}"
        )


def attach_int4pack(
    layer: nn.Module,
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Build the fused layout from unpacked `codes [K, N]`, integer `zeros [G, N]`, `scales`
    and `g_idx [K]`, and register it as buffers on `layer`."""
    pack = torch_ops.build_int4pack(codes, zeros, scales, g_idx, dtype=dtype)
    layer.register_buffer("int4_weight", pack.weight, persistent=False)
    layer.register_buffer("int4_scales_and_zeros", pack.scales_and_zeros, persistent=False)
    layer.register_buffer("int4_gather", pack.gather, persistent=False)
    layer.int4_group_size = pack.group_size
    layer.int4_out_features = codes.shape[1]


def w4a16_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton W4A16 kernels serve this device and activation dtype."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attach_w4a16(layer: nn.Module, packed: w4a16.PackedW4) -> None:
    layer.w4a16_weight = packed


def apply_packed(
    layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """The layer's output through whichever 4-bit runtime it was repacked for, or None when it
    kept the checkpoint tensors (the method then dequantizes)."""
    if getattr(layer, "w4a16_weight", None) is not None:
        return w4a16.w4a16_matmul(x, layer.w4a16_weight, bias)
    if has_int4pack(layer):
        return apply_int4pack(layer, x, bias)
    return None


def has_int4pack(layer: nn.Module) -> bool:
    return getattr(layer, "int4_weight", None) is not None


def apply_int4pack(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch_ops.int4pack_mm(
        x,
        layer.int4_weight,
        layer.int4_scales_and_zeros,
        layer.int4_gather,
        layer.int4_group_size,
        layer.int4_out_features,
    )
    return out if bias is None else out + bias


def drop_parameters(layer: nn.Module, names: tuple[str, ...]) -> None:
    """Free the checkpoint-layout parameters once they were repacked."""
    for name in names:
        delattr(layer, name)
