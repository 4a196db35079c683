"""What AWQ and GPTQ share: shard checks in create_weights and the 4-bit runtimes.

Runtime per device, chosen once in process_weights_after_loading:

* CUDA (compute capability >= 8.0) with fp16/bf16 activations: our Triton W4A16 kernels
  (`quantfw.kernels.w4a16`, layout in docs/kernels-w4a16.md);
* CPU (and CUDA in float32): torch's fused int4pack ops (`quantfw.kernels.torch_ops`);
* otherwise: dequantize on every call (the methods' own fallback).

Every runtime tensor is a non-persistent buffer of the layer (``model.to()``, ``named_buffers``
and memory accounting see it); `runtime_nbytes` is the size the chosen layout should take.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quantfw.kernels import torch_ops, w4a16
from quantfw.kernels.common import triton_available
from quantfw.layers.quantization.base import replace_with_buffers


def attach_int4pack(
    layer: nn.Module,
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    dtype: torch.dtype,
    drop: tuple[str, ...],
) -> None:
    """Build the fused layout from unpacked `codes [K, N]`, integer `zeros [G, N]`, `scales`
    and `g_idx [K]`, register it as buffers on `layer` and drop the parameters `drop`."""
    pack = torch_ops.build_int4pack(codes, zeros, scales, g_idx, dtype=dtype)
    replace_with_buffers(
        layer,
        drop,
        {
            "int4_weight": pack.weight,
            "int4_scales_and_zeros": pack.scales_and_zeros,
            "int4_gather": pack.gather,
        },
    )
    layer.int4_group_size = pack.group_size
    layer.int4_out_features = codes.shape[1]
    layer.int4_rows = codes.shape[0] if pack.gather is None else pack.gather.numel()


def w4a16_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton W4A16 kernels serve this device and activation dtype."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return triton_available()


def attach_w4a16(layer: nn.Module, packed: w4a16.PackedW4, drop: tuple[str, ...]) -> None:
    """Keep `packed`'s tensors as buffers of `layer` (its sizes as attributes) and drop the
    checkpoint parameters `drop`."""
    replace_with_buffers(
        layer,
        drop,
        {
            "w4a16_qweight": packed.qweight,
            "w4a16_scales_zeros": packed.scales_zeros,
            "w4a16_perm": packed.perm,
        },
    )
    layer.w4a16_facts = (packed.group_size, packed.in_features, packed.out_features, packed.dtype)


def w4a16_weight(layer: nn.Module) -> w4a16.PackedW4 | None:
    """The layer's W4A16 weight as a `PackedW4` view of its buffers, or None."""
    if getattr(layer, "w4a16_qweight", None) is None:
        return None
    group_size, k, n, dtype = layer.w4a16_facts
    return w4a16.PackedW4(
        layer.w4a16_qweight, layer.w4a16_scales_zeros, group_size, k, n, layer.w4a16_perm, dtype
    )


def apply_packed(
    layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """The layer's output through whichever 4-bit runtime it was repacked for, or None when it
    kept the checkpoint tensors (the method then dequantizes)."""
    packed = w4a16_weight(layer)
    if packed is not None:
        return w4a16.w4a16_matmul(x, packed, bias)
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


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def runtime_nbytes(layer: nn.Module, checkpoint_nbytes: int) -> int:
    """Bytes the layer's 4-bit runtime keeps, from its sizes and the layout's definition:
    W4A16 (codes padded to 16 x 64, one 32-bit scale/zero word per group and column, int64
    act-order permutation), int4pack (4-bit codes of the planned rows, a (scale, offset) pair
    per kernel group and column, int64 row gather) or `checkpoint_nbytes` when the layer kept
    its checkpoint tensors."""
    facts = getattr(layer, "w4a16_facts", None)
    if facts is not None and getattr(layer, "w4a16_qweight", None) is not None:
        group_size, k, n, _ = facts
        kp, np_ = _round_up(k, 16), _round_up(n, 64)
        perm = k * 8 if layer.w4a16_perm is not None else 0
        return kp * np_ // 2 + math.ceil(k / group_size) * np_ * 4 + perm
    if has_int4pack(layer):
        rows, n = layer.int4_rows, layer.int4_out_features
        np_ = _round_up(n, 16 if layer.int4_weight.device.type == "cpu" else 8)
        pair = 2 * layer.int4_scales_and_zeros.element_size()
        gather = rows * 8 if layer.int4_gather is not None else 0
        return np_ * rows // 2 + rows // layer.int4_group_size * np_ * pair + gather
    return checkpoint_nbytes
