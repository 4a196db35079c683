"""The MXFP4 format (OCP microscaling FP4) as GPT-OSS checkpoints store it: plain torch, the
reference every kernel is checked against.

* Values are FP4 E2M1 codes (sign, 2 exponent bits, 1 mantissa bit): `FP4_VALUES[code]`.
* Every `BLOCK_SIZE` (32) consecutive values along the input dim share one UE8M0 scale byte
  ``s``: the block's values are multiplied by ``2 ** (s - 127)``.
* Two codes per byte, the even-indexed value in the LOW nibble (bits 0-3) and the odd one in the
  high nibble. This is what ``transformers.integrations.mxfp4`` decodes and what FlashInfer's
  own tests pack (some write-ups say the opposite; the bytes say low nibble first).
* Tensors: ``blocks [..., K/32, 16] uint8`` and ``scales [..., K/32] uint8`` for a weight
  ``[..., K]`` (GPT-OSS: ``gate_up_proj_blocks [E, 2I, H/32, 16]``).

`dequantize` computes ``ldexp(value, s - 127)`` exactly and rounds once to the output dtype, as
``transformers.integrations.mxfp4`` does, so results match bit for bit at every exponent
(``s = 255`` scales by ``2**128``: finite in float32 for codes below 1, inf above).
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32
BYTES_PER_BLOCK = BLOCK_SIZE // 2
SCALE_BIAS = 127
#: value of each E2M1 code 0..15
FP4_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
FP4_MAX = 6.0


def check_blocks(blocks: torch.Tensor, scales: torch.Tensor, what: str = "MXFP4 tensor") -> None:
    """Raise a clear error unless blocks [..., G, 16] and scales [..., G] are uint8 and agree."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"{what}: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise ValueError(
            f"{what}: blocks must be [..., K/32, {BYTES_PER_BLOCK}], got {tuple(blocks.shape)}"
        )
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"{what}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree "
            "(scales must be blocks.shape[:-1])"
        )


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> E2M1 codes uint8 [..., 2n] (low nibble first)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., 2n] (values 0..15) -> uint8 [..., n] (even index in the low nibble)."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """blocks [..., G, 16] + scales [..., G] -> weight [..., G*32] in `dtype`."""
    check_blocks(blocks, scales)
    # 2 * value times 2**(s - 128): both factors exact in float32 (2**-128 is a subnormal,
    # 2**127 the largest), so the product rounds once, like ldexp(value, s - 127)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device) * 2
    values = lut[unpack_codes(blocks).long()]  # [..., G, 32]
    factor = torch.pow(2.0, scales.to(torch.int32) - (SCALE_BIAS + 1)).unsqueeze(-1)
    return (values * factor).to(dtype).flatten(-2)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 of `weight [..., K]` (K a multiple of 32) -> (blocks [..., K/32,
    16], scales [..., K/32]). Each block's scale is the smallest power of two that maps its
    largest magnitude into E2M1's range (nothing saturates); values round to the nearest code,
    ties to the even code (mantissa bit 0)."""
    k = weight.shape[-1]
    if k % BLOCK_SIZE:
        raise ValueError(
            f"MXFP4 quantize: the last dim ({k}) must be a multiple of {BLOCK_SIZE}, shape "
            f"{tuple(weight.shape)}"
        )
    w = weight.detach().float().unflatten(-1, (k // BLOCK_SIZE, BLOCK_SIZE))
    if not torch.isfinite(w).all():
        raise ValueError("MXFP4 quantize: the weight holds inf or NaN")
    amax = w.abs().amax(dim=-1)
    # smallest e with amax / 2**e <= 6; frexp is exact where log2 would round
    mantissa, exponent = torch.frexp(amax / FP4_MAX)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # amax/6 an exact power of two
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))
    exponent = exponent.clamp(-SCALE_BIAS, 254 - SCALE_BIAS)
    scaled = w / torch.pow(2.0, exponent.float()).unsqueeze(-1)
    return pack_codes(_nearest_code(scaled)), (exponent + SCALE_BIAS).to(torch.uint8)


def _nearest_code(x: torch.Tensor) -> torch.Tensor:
    """E2M1 code of the grid value nearest to each element of x (|x| <= 6; ties to even)."""
    magnitudes = torch.tensor(FP4_VALUES[:8], dtype=x.dtype, device=x.device)
    mag = x.abs().clamp(max=FP4_MAX)
    upper = torch.searchsorted(magnitudes, mag).clamp(max=7)  # first grid value >= mag
    lower = (upper - 1).clamp(min=0)
    d_up, d_low = magnitudes[upper] - mag, mag - magnitudes[lower]
    # on a tie prefer the even code (mantissa bit 0)
    pick_up = (d_up < d_low) | ((d_up == d_low) & (upper % 2 == 0))
    code = torch.where(pick_up, upper, lower)
    sign = ((x < 0) & (code > 0)).to(code.dtype) * 8
    return (code + sign).to(torch.uint8)
