"""The MXFP4 bytes: our decode equals transformers' bit for bit (every byte under every scale
exponent, in float32, bfloat16 and float16), the nibble order, and the exporter's encoder."""

from __future__ import annotations

import pytest
import torch

from quantfw.kernels import mxfp4

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_BITS = {4: torch.int32, 2: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.element_size()])


def _transformers_dequant(blocks, scales, dtype):
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    # transformers returns the experts' [E, K, N] (transposed) layout
    return convert(blocks.clone(), scales.clone(), dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_byte_under_every_scale_matches_transformers(dtype):
    # rows: the 256 scale bytes (0 and 255 included); each row's 16 groups hold all 256 bytes
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 16).contiguous()
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 256, 16, 16)
    ours = mxfp4.dequantize(blocks.contiguous(), scales, dtype)
    ref = _transformers_dequant(blocks.contiguous(), scales, dtype)
    assert ours.shape == ref.shape == (1, 256, 16 * 32)
    assert torch.equal(_bits(ours), _bits(ref))
    assert torch.isinf(ours).any()  # the extremes really were exercised


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_blocks_match_transformers(dtype):
    g = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (3, 24, 5, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 24, 5), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales, dtype)
    assert torch.equal(_bits(ours), _bits(_transformers_dequant(blocks, scales, dtype)))


def test_low_nibble_holds_the_even_value():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x2F  # low nibble 0xF (-6.0) is value 0, high nibble 0x2 (1.0) is value 1
    scales = torch.full((1,), 128, dtype=torch.uint8)  # 2**1
    w = mxfp4.dequantize(blocks, scales, torch.float32)
    assert w[:2].tolist() == [-12.0, 2.0]
    assert (w[2:] == 0).all()
    codes = torch.tensor([[15, 2] + [0] * 30], dtype=torch.uint8)
    assert torch.equal(mxfp4.pack_codes(codes)[0], blocks[0])
    assert torch.equal(mxfp4.unpack_codes(blocks[0]), codes[0])


def test_quantize_represents_grid_values_exactly_and_rounds_to_nearest():
    g = torch.Generator().manual_seed(3)
    # values already on an MXFP4 grid (with the block's max at a power-of-two times 6)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    codes[:, 0] = 7  # +6.0 in each block: the scale is fully used
    codes[:, 32] = 15
    exps = torch.randint(-20, 20, (8, 2), generator=g)
    grid = torch.tensor(mxfp4.FP4_VALUES)[codes.long()].view(8, 2, 32) * torch.pow(
        2.0, exps.float()
    ).unsqueeze(-1)
    blocks, scales = mxfp4.quantize(grid.flatten(-2))
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.float32), grid.flatten(-2))
    # random weights: every value within half a grid step of its block's scale
    w = torch.randn(16, 256, generator=g) * torch.logspace(-3, 2, 16).unsqueeze(-1)
    blocks, scales = mxfp4.quantize(w)
    back = mxfp4.dequantize(blocks, scales, torch.float32)
    step = torch.pow(2.0, scales.float() - 127).repeat_interleave(32, dim=-1)  # grid step <= 2*s
    assert ((back - w).abs() <= step + 1e-12).all()
    amax = w.view(16, 8, 32).abs().amax(-1)
    assert (amax / torch.pow(2.0, scales.float() - 127) <= 6).all()  # nothing saturates
    assert (amax / torch.pow(2.0, scales.float() - 127) > 3).all()  # and the scale is tight


def test_quantize_ties_go_to_the_even_code_and_zero_blocks_stay_zero():
    w = torch.zeros(2, 32)
    w[0, :5] = torch.tensor([6.0, 0.25, 0.75, 2.5, 5.0])  # ties between grid neighbours
    blocks, scales = mxfp4.quantize(w)
    back = mxfp4.dequantize(blocks, scales, torch.float32)
    assert back[0, :5].tolist() == [6.0, 0.0, 1.0, 2.0, 4.0]
    assert (back[1] == 0).all() and torch.isfinite(back).all()


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="disagree"):
        mxfp4.dequantize(
            torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8)
        )
