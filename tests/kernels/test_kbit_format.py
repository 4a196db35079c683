"""The kbit format module (codebooks, E4M4, bit planes, reference quantize/dequantize) against
the spec's error budget on 1M normal elements and against plain-Python readings of the format."""

from __future__ import annotations

import math

import pytest
import torch

from quantfw.kernels.kbit import format as F

SQNR_MIN_DB = {2: 5.0, 3: 10.0, 4: 15.0, 5: 20.0}
N = 1 << 20


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(float((x**2).sum() / ((x - y) ** 2).sum()))


@pytest.fixture(scope="module")
def normal_1m() -> torch.Tensor:
    return torch.randn(N // 1024, 1024, generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("bits", F.SUPPORTED_BITS)
def test_error_budget_on_1m_normal_elements(bits, normal_1m):
    x = normal_1m
    cb = F.normal_float_codebook(bits)
    planes, absmax = F.quantize(x, bits)
    assert planes.shape == (1024, 32, bits) and planes.dtype == torch.int32
    assert absmax.shape == (1024, 32) and absmax.dtype == torch.uint8
    y = F.dequantize(planes, absmax, cb)
    assert y.shape == x.shape
    got = sqnr_db(x, y)
    assert got > SQNR_MIN_DB[bits], f"K={bits}: SQNR {got:.2f} dB"
    # the same levels with the fp32 absmax: E4M4 costs less than 1.5 dB
    blocks = x.reshape(-1, 32)
    a32 = blocks.abs().amax(-1, keepdim=True)
    y32 = cb[F.nearest_level(blocks / a32, cb)] * a32
    assert sqnr_db(blocks, y32) - got < 1.5
    # per block: max error <= (max_gap / 2 + 1/16) * absmax + 1e-6
    max_gap = float((cb[1:] - cb[:-1]).max())
    err = (blocks - y.reshape(-1, 32)).abs().amax(-1)
    bound = (max_gap / 2 + 1 / 16) * blocks.abs().amax(-1) + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())


def test_normal_float_codebooks():
    for bits in F.SUPPORTED_BITS:
        cb = F.normal_float_codebook(bits)
        assert cb.shape == (1 << bits,) and cb.dtype == torch.float32
        assert cb[0] == -1 and cb[-1] == 1
        assert bool((cb[1:] > cb[:-1]).all())
        assert torch.equal(cb, -cb.flip(0))
    # K = 2: E[Z | Z > q(3/4)] = 4 phi(q(3/4)) and E[Z | 0 < Z < q(3/4)] = 4 (phi(0) - phi(q))
    q = 0.6744897501960817
    phi = math.exp(-q * q / 2) / math.sqrt(2 * math.pi)
    inner = 4 * (1 / math.sqrt(2 * math.pi) - phi) / (4 * phi)
    assert F.normal_float_codebook(2).tolist() == pytest.approx([-1, -inner, inner, 1], abs=1e-6)


# ---------------------------------------------------------------------------------------------
# E4M4


def py_e4m4(code: int) -> float:
    e, m = code >> 4, code & 0xF
    return 2.0 ** (e - 11) * (1 + m / 16) if e else 2.0**-10 * m / 16


def test_e4m4_table_round_trip_monotone_unique():
    table = F.e4m4_values()
    assert table.tolist() == [py_e4m4(c) for c in range(256)]
    assert table[0] == 0 and table[-1] == 31.0
    assert bool((table[1:] > table[:-1]).all())  # strictly increasing: unique, monotone
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(F.encode_e4m4(F.decode_e4m4(codes)), codes)


def test_e4m4_subnormals_and_zero():
    codes = torch.arange(16, dtype=torch.uint8)  # exponent field 0
    assert F.decode_e4m4(codes).tolist() == [m * 2.0**-14 for m in range(16)]
    assert F.decode_e4m4(torch.tensor([16], dtype=torch.uint8)).item() == 2.0**-10
    tiny = torch.tensor([0.0, 2.0**-16, 2.0**-15 + 1e-9, 3.4 * 2.0**-14])
    assert F.encode_e4m4(tiny).tolist() == [0, 0, 1, 3]


def test_e4m4_encode_is_nearest_and_monotone():
    gen = torch.Generator().manual_seed(3)
    v = torch.exp(torch.empty(20000).uniform_(math.log(1e-6), math.log(31.4), generator=gen))
    codes = F.encode_e4m4(v)
    table = F.e4m4_values().double()
    dist = (table[codes.long()] - v.double()).abs()
    best = (table.unsqueeze(0) - v.double().unsqueeze(1)).abs().amin(1)
    assert torch.equal(dist, best)
    normal = v >= 2.0**-10
    rel = dist[normal] / v[normal].double()
    assert float(rel.max()) <= 1 / 32 + 1e-7
    order = torch.argsort(v)
    assert bool((codes[order][1:].long() >= codes[order][:-1].long()).all())


def test_e4m4_rejects_what_it_cannot_store():
    with pytest.raises(ValueError, match=r"w absmax: a block's absolute maximum 40 exceeds"):
        F.encode_e4m4(torch.tensor([1.0, 40.0]), "w absmax")
    assert F.encode_e4m4(torch.tensor([31.4])).item() == 255
    with pytest.raises(ValueError, match="non-negative"):
        F.encode_e4m4(torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="non-finite"):
        F.encode_e4m4(torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="uint8"):
        F.decode_e4m4(torch.tensor([1], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# bit planes and the reference quantizer against plain Python


def py_pack(indices: list[int], bits: int) -> list[int]:
    words = []
    for b in range(bits):
        word = sum(((i >> b) & 1) << lane for lane, i in enumerate(indices))
        words.append(word - 2**32 if word >= 2**31 else word)
    return words


@pytest.mark.parametrize("bits", F.SUPPORTED_BITS)
def test_bitplanes_match_the_definition(bits):
    gen = torch.Generator().manual_seed(bits)
    idx = torch.randint(0, 1 << bits, (5, 32), generator=gen)
    idx[0] = (1 << bits) - 1  # every bit set: word -1 (lane 31 is the sign bit)
    planes = F.pack_bitplanes(idx, bits)
    assert planes.tolist() == [py_pack(row, bits) for row in idx.tolist()]
    assert planes[0].tolist() == [-1] * bits
    assert torch.equal(F.unpack_bitplanes(planes).long(), idx)


def py_quantize_block(block: list[float], codebook: list[float]) -> tuple[list[int], int]:
    absmax = max(abs(v) for v in block)
    table = [py_e4m4(c) for c in range(256)]
    code = min(range(256), key=lambda c: (abs(table[c] - absmax), -c))
    scale = table[code]
    idx = [
        min(
            range(len(codebook)),
            key=lambda j: abs(v / scale - codebook[j]) if scale else abs(codebook[j]),
        )
        for v in block
    ]
    return idx, code


@pytest.mark.parametrize("bits", F.SUPPORTED_BITS)
def test_reference_quantizer_matches_plain_python(bits):
    gen = torch.Generator().manual_seed(100 + bits)
    x = torch.randn(3, 64, generator=gen) * torch.tensor([[0.02], [1.5], [7.0]])
    x[2, 32:] = 0  # an all-zero block: scale 0, levels nearest 0
    cb = F.normal_float_codebook(bits)
    planes, absmax = F.quantize(x, bits)
    idx = F.unpack_bitplanes(planes).long()
    for r in range(3):
        for b in range(2):
            want_idx, want_code = py_quantize_block(
                x[r, 32 * b : 32 * b + 32].tolist(), cb.tolist()
            )
            assert absmax[r, b].item() == want_code
            assert idx[r, b].tolist() == want_idx
    y = F.dequantize(planes, absmax, cb)
    assert torch.equal(y[2, 32:], torch.zeros(32))
    assert torch.equal(y, cb[idx].reshape(3, 64) * F.decode_e4m4(absmax).repeat_interleave(32, 1))


@pytest.mark.parametrize(
    "codebook",
    [
        [0.0, 0.25, 0.5, 1.0],  # all positive
        [-1.0, -0.75, -0.5, 0.0],  # all negative
        [-1.0, -0.9, -0.1, 0.6],  # skewed
        [-0.5, 0.0, 0.1, 2.0],  # beyond [-1, 1]
    ],
)
def test_custom_codebooks(codebook):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 128, generator=gen)
    cb = torch.tensor(codebook)
    planes, absmax = F.quantize(x, 2, cb)
    idx = F.unpack_bitplanes(planes).long()
    scale = F.decode_e4m4(absmax).unsqueeze(-1)
    blocks = x.reshape(16, 4, 32)
    # every element takes the level nearest to it on the stored scale
    dist = (blocks.unsqueeze(-1) / scale.unsqueeze(-1) - cb).abs()
    assert torch.equal(dist.gather(-1, idx.unsqueeze(-1)).squeeze(-1), dist.amin(-1))
    y = F.dequantize(planes, absmax, cb)
    assert torch.allclose(y, (cb[idx] * scale).reshape(16, 128))


def test_bad_input_errors():
    x = torch.randn(4, 64)
    for bits in (1, 6, 4.0, True):
        with pytest.raises(
            ValueError, match=r"bits=.* is not supported; supported: \[2, 3, 4, 5\]"
        ):
            F.quantize(x, bits)
    with pytest.raises(ValueError, match=r"blocksize=64 is not supported; supported: \[32\]"):
        F.check_blocksize(64)
    with pytest.raises(ValueError, match=r"a 3-bit codebook has shape \[8\], got \[4\]"):
        F.quantize(x, 3, torch.tensor([-1.0, 0.0, 0.5, 1.0]))
    with pytest.raises(ValueError, match="strictly ascending"):
        F.quantize(x, 2, torch.tensor([-1.0, 0.5, 0.0, 1.0]))
    with pytest.raises(ValueError, match="non-finite"):
        F.check_codebook([-1.0, 0.0, float("inf"), 2.0], 2)
    with pytest.raises(ValueError, match=r"w: .*shape \[4, 40\] has 40 there"):
        F.quantize(torch.randn(4, 40), 4, name="w")
    with pytest.raises(ValueError, match="non-finite"):
        F.quantize(torch.tensor([float("inf")] * 32), 4)
    planes, absmax = F.quantize(x, 4)
    with pytest.raises(ValueError, match=r"kbit_planes \[4, 2, 4\] and kbit_absmax \[4, 3\]"):
        F.dequantize(planes, torch.zeros(4, 3, dtype=torch.uint8), F.normal_float_codebook(4))
    with pytest.raises(ValueError, match="int32"):
        F.dequantize(planes.long(), absmax, F.normal_float_codebook(4))
