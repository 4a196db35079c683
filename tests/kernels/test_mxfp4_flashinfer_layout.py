"""FlashInfer's Blackwell grouped-GEMM layout rules, checked on the CPU against their
definitions: the 128x4 scale swizzle (element by element against the offset formula of
TensorRT-LLM / FlashInfer's ``block_scale_interleave``), per-group a_scale placement at
``m_indptr_padded``, rows padded to 4 per group, weights padded to N % 8 and K % 128."""

from __future__ import annotations

import torch

from quantfw.kernels.mxfp4 import flashinfer_layout as fl


def _offset_128x4(m: int, k: int, kg_pad: int) -> int:
    """get_sf_out_offset_128x4 spelled out: [m tile][k tile][m % 32][(m % 128) // 32][k % 4]."""
    inner_k, inner_m, outer_m = k % 4, (m % 128) // 32, m % 32
    return (m // 128) * (kg_pad // 4) * 512 + (k // 4) * 512 + outer_m * 16 + inner_m * 4 + inner_k


def test_swizzle_matches_the_offset_formula_and_round_trips():
    g = torch.Generator().manual_seed(0)
    sf = torch.randint(1, 256, (2, 200, 7), generator=g, dtype=torch.uint8)
    out = fl.swizzle_scales(sf)
    assert out.shape == (2, 256, 8)
    for b in range(2):
        flat = out[b].reshape(-1)
        expected = torch.zeros_like(flat)
        for m in range(200):
            for k in range(7):
                expected[_offset_128x4(m, k, 8)] = sf[b, m, k]
        assert torch.equal(flat, expected)  # padding bytes are zero too
    assert torch.equal(fl.unswizzle_scales(out, 200, 7), sf)
    m, k = torch.arange(200).unsqueeze(1), torch.arange(7).unsqueeze(0)
    assert torch.equal(
        fl.swizzled_offset(m, k, 8),
        torch.tensor([[_offset_128x4(i, j, 8) for j in range(7)] for i in range(200)]),
    )


def test_m_indptr_padded_and_rows_padded_per_group():
    assert fl.m_indptr_padded(torch.tensor([0, 128, 256])).tolist() == [0, 128, 384]
    assert fl.m_indptr_padded(torch.tensor([0, 50, 80, 120])).tolist() == [0, 128, 256, 384]
    m_indptr = torch.tensor([0, 5, 5, 8])
    expert_of_row = torch.tensor([0] * 5 + [2] * 3)
    padded, dest = fl.pad_group_rows(m_indptr, expert_of_row, 4)
    assert padded.tolist() == [0, 8, 8, 12]
    assert dest.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert fl.padded_rows_bound(8, 3, 4) >= int(padded[-1])


def test_grouped_scales_sit_swizzled_at_each_groups_padded_start():
    g = torch.Generator().manual_seed(1)
    m_indptr = torch.tensor([0, 50, 50, 180, 183])  # one empty group, one longer than 128
    rows, kg = 183 + 5, 6  # 5 trailing rows belong to no group
    sf = torch.randint(1, 256, (rows, kg), generator=g, dtype=torch.uint8)
    group_of_row = torch.searchsorted(m_indptr[1:], torch.arange(rows), right=True)
    out = fl.swizzle_grouped_scales(sf, m_indptr, group_of_row)
    starts = fl.m_indptr_padded(m_indptr)
    assert out.shape == ((rows + 4 * 127) // 128 * 128, 8)
    assert out.shape[0] >= int(starts[-1])
    expected = torch.zeros_like(out)
    for grp in range(4):
        lo, hi = int(m_indptr[grp]), int(m_indptr[grp + 1])
        if hi > lo:
            block = fl.swizzle_scales(sf[lo:hi].unsqueeze(0))[0]
            s = int(starts[grp])
            expected[s : s + block.shape[0]] = block
    assert torch.equal(out, expected)


def test_weights_pad_to_n8_k128_with_zeros():
    blocks = torch.randint(0, 256, (3, 13, 3, 16), dtype=torch.uint8)  # N = 13, K = 96
    scales = torch.randint(1, 256, (3, 13, 3), dtype=torch.uint8)
    b, s = fl.pad_weights(blocks, scales)
    assert b.shape == (3, 16, 64) and s.shape == (3, 16, 4)
    assert torch.equal(b[:, :13, :48], blocks.reshape(3, 13, 48))
    assert (b[:, 13:] == 0).all() and (b[:, :, 48:] == 0).all()
    assert (
        torch.equal(s[:, :13, :3], scales) and (s[:, 13:] == 0).all() and (s[:, :, 3:] == 0).all()
    )
