"""Pack/unpack/dequant against plain-Python readings of the AWQ and GPTQ specs, and the fused
int4pack path against dequantize + matmul."""

from __future__ import annotations

import pytest
import torch

from quantfw.kernels import reference, torch_ops


def _signed(word: int) -> int:
    return word - 2**32 if word >= 2**31 else word


def py_pack_gptq_rows(codes: list[list[int]], bits: int) -> list[list[int]]:
    """GPTQ qweight packing, one bit stream per column: code k at stream bit k*bits, word w
    holding stream bits [32w, 32w+32) (3-bit codes straddle words, as AutoGPTQ's loop does)."""
    rows, cols = len(codes), len(codes[0])
    words = rows * bits // 32
    out = [[0] * cols for _ in range(words)]
    for c in range(cols):
        stream = 0
        for k in range(rows):
            stream |= codes[k][c] << (k * bits)
        for w in range(words):
            out[w][c] = _signed((stream >> (32 * w)) & 0xFFFFFFFF)
    return out


def py_pack_awq(codes: list[list[int]]) -> list[list[int]]:
    """AWQ: output element i of a group of 8 sits at bit ((i & 1) ? (4 + i/2) : i/2) * 4
    (reference 000, section 1.5)."""
    out = []
    for row in codes:
        words = []
        for c in range(len(row) // 8):
            word = 0
            for i in range(8):
                pos = ((4 + i // 2) if i & 1 else i // 2) * 4
                word |= row[8 * c + i] << pos
            words.append(_signed(word))
        out.append(words)
    return out


def py_dequant(codes, zeros, scales, g_idx):
    return [
        [(codes[k][o] - zeros[g_idx[k]][o]) * scales[g_idx[k]][o] for o in range(len(codes[0]))]
        for k in range(len(codes))
    ]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_pack_matches_python_reference(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (96, 24), generator=g, dtype=torch.int32)
    expected = torch.tensor(py_pack_gptq_rows(codes.tolist(), bits), dtype=torch.int32)
    packed = reference.pack_int32(codes, bits, dim=0)
    assert torch.equal(packed, expected)
    assert torch.equal(reference.unpack_int32(packed, bits, dim=0), codes)
    # along the output dim (qzeros) the same stream runs along each row
    packed_t = reference.pack_int32(codes.t(), bits, dim=1)
    assert torch.equal(packed_t, expected.t())
    assert torch.equal(reference.unpack_int32(packed_t, bits, dim=1), codes.t())


def test_gptq_3bit_word_boundaries():
    codes = torch.zeros(32, 1, dtype=torch.int32)
    codes[10, 0] = 0b101  # bits 30, 31 of word 0 and bit 0 of word 1
    codes[21, 0] = 0b110  # bit 31 of word 1 and bits 0, 1 of word 2
    packed = reference.pack_int32(codes, 3, dim=0)[:, 0].tolist()
    assert packed == [_signed(0b01 << 30), _signed((0b0 << 31) | 1), 0b11]


def test_awq_pack_matches_python_reference():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (5, 40), generator=g, dtype=torch.int32)
    expected = torch.tensor(py_pack_awq(codes.tolist()), dtype=torch.int32)
    packed = reference.pack_awq(codes)
    assert torch.equal(packed, expected)
    assert torch.equal(reference.unpack_awq(packed), codes)
    # element 1 of a word lives in bits 16..19
    one = torch.zeros(1, 8, dtype=torch.int32)
    one[0, 1] = 0xF
    assert int(reference.pack_awq(one)) == 0xF << 16


@pytest.mark.parametrize("in_features,group_size", [(96, 32), (80, 32), (64, -1)])
def test_gptq_dequant_odd_groups(in_features, group_size):
    g = torch.Generator().manual_seed(in_features)
    out = 16
    g_idx = reference.group_index(in_features, group_size)
    groups = int(g_idx.max()) + 1
    codes = torch.randint(0, 16, (in_features, out), generator=g, dtype=torch.int32)
    zeros = torch.randint(1, 17, (groups, out), generator=g, dtype=torch.int32)  # v1: 1..16
    scales = torch.rand(groups, out, generator=g).half()
    got = reference.dequantize_gptq(
        reference.pack_int32(codes, 4, 0),
        reference.pack_int32(zeros - 1, 4, 1),  # v1 stores z - 1
        scales,
        g_idx,
        4,
        zero_offset=1,
    )
    want = py_dequant(codes.tolist(), zeros.tolist(), scales.float().tolist(), g_idx.tolist())
    torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=0)


def test_awq_dequant_matches_python_reference():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (96, 24), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (3, 24), generator=g, dtype=torch.int32)
    scales = torch.rand(3, 24, generator=g).half()
    got = reference.dequantize_awq(reference.pack_awq(codes), reference.pack_awq(zeros), scales, 32)
    want = py_dequant(
        codes.tolist(), zeros.tolist(), scales.float().tolist(), (torch.arange(96) // 32).tolist()
    )
    torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=0)


def _fused_vs_dequant(k, n, g_idx, num_groups, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (num_groups, n), generator=g, dtype=torch.int32)
    scales = torch.rand(num_groups, n, generator=g) + 0.1
    pack = torch_ops.build_int4pack(codes, zeros, scales, g_idx, dtype=dtype)
    x = torch.randn(3, 5, k, generator=g)
    got = torch_ops.int4pack_mm(
        x.to(dtype), pack.weight, pack.scales_and_zeros, pack.gather, pack.group_size, n
    )
    want = x @ reference.dequantize(codes, zeros, scales, g_idx)
    err = (got.float() - want).abs().max() / want.abs().max()
    return err.item(), pack


def test_int4pack_plain_groups_needs_no_gather():
    err, pack = _fused_vs_dequant(256, 64, torch.arange(256) // 128, 2, 0)
    assert err < 1e-5
    assert pack.gather is None and pack.group_size == 128


def test_int4pack_act_order_random_permutation():
    k, gs = 256, 64
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(5))
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // gs
    err, pack = _fused_vs_dequant(k, 48, g_idx, k // gs, 1)
    assert err < 1e-5
    assert pack.gather is not None and pack.gather.numel() == k  # a pure permutation


@pytest.mark.parametrize("k,n", [(80, 24), (200, 40), (48, 8)])
def test_int4pack_pads_unaligned_shapes_and_uneven_groups(k, n):
    g_idx = torch.randint(0, 3, (k,), generator=torch.Generator().manual_seed(k))
    err, pack = _fused_vs_dequant(k, n, g_idx, 3, 2)
    assert err < 1e-5
    assert pack.gather.numel() > k  # groups padded to the kernel group size


def test_int4pack_bf16():
    err, _ = _fused_vs_dequant(128, 32, torch.arange(128) // 32, 4, 3, dtype=torch.bfloat16)
    assert err < 2e-2
