"""The CUDA runtime layout of MXFP4 weights (`mxfp4.layout`): padding, the quad interleave, the
round trip, and the input order a contiguous tile decodes in."""

from __future__ import annotations

import pytest
import torch

from quantfw.kernels import mxfp4
from quantfw.kernels.mxfp4 import layout


def test_pack_interleaves_quads_pads_and_round_trips():
    g = torch.Generator().manual_seed(0)
    blocks, scales = mxfp4.quantize(torch.randn(3, 70, 160, generator=g))  # 5 blocks per row
    qweight, s = layout.pack(blocks, scales)
    assert qweight.dtype == torch.int32 and tuple(qweight.shape) == (3, 128, 8 * 4)
    assert s.dtype == torch.uint8 and tuple(s.shape) == (3, 128, 8)
    words = blocks.view(torch.int32)  # [3, 70, 5, 4]: word j of block b
    for b in range(5):
        for j in range(4):
            assert torch.equal(qweight[:, :70, 16 * (b // 4) + 4 * j + b % 4], words[:, :, b, j])
    assert not qweight[:, 70:].any() and not s[:, 70:].any()  # padded rows
    per_block = qweight.reshape(3, 128, 2, 4, 4).transpose(-1, -2).reshape(3, 128, 8, 4)
    assert torch.equal(per_block[:, :70, :5], words)
    assert not per_block[:, :, 5:].any() and not s[:, :, 5:].any()  # padded blocks
    back = layout.unpack(qweight, s, 70, 160)
    assert torch.equal(back[0], blocks) and torch.equal(back[1], scales)


def test_a_contiguous_quad_decodes_in_quad_order():
    """Byte 64q + 16j + 4r + b of a packed row holds inputs 128q + 32r + 8j + 2b (+1): the
    order the Triton tiles load the activations in (kbit's ``quad_k`` for K = 4)."""
    g = torch.Generator().manual_seed(1)
    blocks, scales = mxfp4.quantize(torch.randn(2, 256, generator=g))
    qweight, _ = layout.pack(blocks, scales)
    row_bytes = qweight[:2].view(torch.uint8)  # [2, 128] (rows padded to 64)
    codes = mxfp4.unpack_codes(row_bytes)  # [2, 256]: position 2 * byte + nibble
    want = mxfp4.unpack_codes(blocks.reshape(2, 128))  # input order
    v = torch.arange(256)  # position 2 * byte + nibble
    byte, nibble = v // 2, v % 2
    q, j, r, b = byte // 64, (byte // 16) % 4, (byte // 4) % 4, byte % 4
    order = 128 * q + 32 * r + 8 * j + 2 * b + nibble
    quad_k = 128 * (v // 128) + 32 * ((v // 8) % 4) + 8 * ((v // 32) % 4) + v % 8
    assert torch.equal(order, quad_k)  # kbit/triton/kernels.quad_k(256, 4), written out
    assert torch.equal(codes, want[:, order])
    assert sorted(order.tolist()) == list(range(256))


def test_bad_blocks_are_named():
    with pytest.raises(ValueError, match=r"MXFP4 pack: blocks must be \[\.\.\., K/32, 16\]"):
        layout.pack(torch.zeros(4, 2, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
