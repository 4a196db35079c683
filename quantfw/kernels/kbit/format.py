"""The kbit format: normal-float codebooks, E4M4 block scales, bit-plane packing, and the plain
reference quantize / dequantize that every kbit kernel is tested against.

Blocks of ``BLOCKSIZE = 32`` consecutive elements along the last dimension (a linear weight's
input features). For a block ``x[0..31]`` with ``K`` bits and a sorted codebook ``c`` of ``2**K``
levels in [-1, 1]:

* ``absmax = max |x[l]|``, stored as one E4M4 byte ``e``; ``a = decode_e4m4(e)``;
* index ``i[l]`` = the level nearest ``x[l] / a`` (levels compared on the stored scale ``a``, so
  the assignment is nearest for what dequantization reconstructs; ``a = 0`` gives the level
  nearest 0);
* ``K`` bit-plane words (uint32 bit patterns, stored as int32): bit ``l`` of word ``b`` is bit
  ``b`` of ``i[l]``;
* dequantized ``x'[l] = c[i[l]] * a``.

E4M4 (bias 11): byte ``e = 16 * E + M``; ``E > 0``: ``2**(E - 11) * (1 + M / 16)``; ``E = 0``:
``2**-10 * M / 16`` (subnormal; ``e = 0`` is zero). The largest value is 31; byte order equals
value order, so encoding is a nearest search over the 256 values.
"""

from __future__ import annotations

import functools
import math

import torch

SUPPORTED_BITS = (2, 3, 4, 5)
BLOCKSIZE = 32
E4M4_BIAS = 11
E4M4_MAX = 31.0
#: the largest absmax that encodes (to E4M4_MAX): half a step (1.0 at the top exponent) above it
E4M4_ENCODABLE = E4M4_MAX + 0.5

#: elements quantized per chunk, bounding temporaries when a whole weight is quantized at once
_CHUNK = 1 << 22


def check_bits(bits: int, what: str = "kbit") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(
            f"{what}: bits={bits!r} is not supported; supported: {list(SUPPORTED_BITS)}"
        )
    return bits


def check_blocksize(blocksize: int, what: str = "kbit") -> int:
    if blocksize != BLOCKSIZE:
        raise ValueError(f"{what}: blocksize={blocksize!r} is not supported; supported: [32]")
    return blocksize


@functools.cache
def _normal_float_levels(bits: int) -> tuple[float, ...]:
    n = 1 << bits
    p = torch.arange(n + 1, dtype=torch.float64) / n
    edges = torch.special.ndtri(p)  # -inf, quantiles, +inf
    pdf = torch.exp(-0.5 * edges**2) / math.sqrt(2 * math.pi)  # 0 at +-inf
    # E[Z | edge_j < Z < edge_j+1] for Z ~ N(0, 1), each bin holding probability 1 / n
    levels = (pdf[:-1] - pdf[1:]) * n
    levels = (levels - levels.flip(0)) / 2  # exact symmetry (the two halves agree to rounding)
    return tuple((levels / levels.abs().max()).tolist())


def normal_float_codebook(bits: int) -> torch.Tensor:
    """float32 ``[2**bits]``: the expected values of N(0, 1) within ``2**bits`` equiprobable bins,
    divided by the largest (sorted ascending, symmetric, ``c[0] = -1``, ``c[-1] = 1``)."""
    check_bits(bits)
    return torch.tensor(_normal_float_levels(bits), dtype=torch.float32)


def check_codebook(codebook, bits: int, name: str = "codebook") -> torch.Tensor:
    """`codebook` as a float32 tensor ``[2**bits]`` if it is one: finite, strictly ascending;
    a ValueError naming `name` and what is wrong otherwise."""
    check_bits(bits)
    cb = torch.as_tensor(codebook).detach()
    if not cb.is_floating_point():
        cb = cb.to(torch.float64)
    cb = cb.to(device="cpu", dtype=torch.float32)
    want = 1 << bits
    if cb.dim() != 1 or cb.numel() != want:
        raise ValueError(f"{name}: a {bits}-bit codebook has shape [{want}], got {list(cb.shape)}")
    if not bool(torch.isfinite(cb).all()):
        raise ValueError(f"{name}: codebook holds non-finite values: {cb.tolist()}")
    if not bool((cb[1:] > cb[:-1]).all()):
        raise ValueError(f"{name}: codebook must be strictly ascending, got {cb.tolist()}")
    return cb


# ---------------------------------------------------------------------------------------------
# E4M4


@functools.cache
def _e4m4_table() -> torch.Tensor:
    e = torch.arange(256) >> 4
    m = (torch.arange(256) & 0xF).to(torch.float64)
    normal = torch.pow(2.0, (e - E4M4_BIAS).to(torch.float64)) * (1 + m / 16)
    subnormal = 2.0 ** (1 - E4M4_BIAS) * m / 16
    return torch.where(e > 0, normal, subnormal).to(torch.float32)


def e4m4_values() -> torch.Tensor:
    """float32 ``[256]``: the value of every E4M4 byte (ascending)."""
    return _e4m4_table().clone()


def decode_e4m4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M4 bytes -> float32 values (same shape and device)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"decode_e4m4: E4M4 codes are uint8, got {codes.dtype}")
    return _e4m4_table().to(codes.device)[codes.long()]


def encode_e4m4(values: torch.Tensor, name: str = "absmax") -> torch.Tensor:
    """Non-negative values -> the nearest E4M4 byte (uint8; a tie goes to the larger value).
    Values above ``E4M4_ENCODABLE`` (31.5), negative or non-finite are a ValueError naming
    `name`."""
    v = values.detach().to(torch.float32)
    if v.numel():
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"{name}: non-finite values cannot be stored as E4M4")
        lo, hi = float(v.min()), float(v.max())
        if lo < 0:
            raise ValueError(f"{name}: E4M4 stores non-negative scales, got {lo}")
        if hi > E4M4_ENCODABLE:
            raise ValueError(
                f"{name}: a block's absolute maximum {hi:g} exceeds the E4M4 range (largest "
                f"value {E4M4_MAX:g}); kbit cannot store this tensor"
            )
    table = _e4m4_table().to(v.device)
    midpoints = (table[1:] + table[:-1]) / 2
    return torch.bucketize(v, midpoints, right=True).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# bit planes


def pack_bitplanes(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """Indices ``[..., 32]`` (values below ``2**bits``) -> int32 words ``[..., bits]``: bit
    ``l`` of word ``b`` is bit ``b`` of ``indices[..., l]``."""
    if indices.shape[-1] != BLOCKSIZE:
        raise ValueError(f"pack_bitplanes: the last dim must be {BLOCKSIZE}, got {indices.shape}")
    idx = indices.to(torch.int64)
    lanes = torch.arange(BLOCKSIZE, device=idx.device)
    words = [(((idx >> b) & 1) << lanes).sum(-1) for b in range(bits)]
    words = torch.stack(words, dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bitplanes(planes: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., bits]`` -> indices uint8 ``[..., 32]`` (inverse of pack_bitplanes)."""
    lanes = torch.arange(BLOCKSIZE, device=planes.device)
    w = planes.to(torch.int64).unsqueeze(-2)  # [..., 1, bits]
    bitvals = (w >> lanes.unsqueeze(-1)) & 1  # [..., 32, bits]
    weights = 1 << torch.arange(planes.shape[-1], device=planes.device)
    return (bitvals * weights).sum(-1).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# quantize / dequantize (reference)


def nearest_level(values: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """int64 index of the level of the sorted `codebook` nearest to each value (a value exactly
    between two levels takes the lower one)."""
    cb = codebook.to(device=values.device, dtype=torch.float32)
    midpoints = (cb[1:] + cb[:-1]) / 2
    return torch.bucketize(values.to(torch.float32), midpoints, right=False)


def _blocks(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % BLOCKSIZE:
        raise ValueError(
            f"{name}: kbit quantizes blocks of {BLOCKSIZE} along the last dim; shape "
            f"{list(x.shape)} has {x.shape[-1] if x.dim() else 0} there (not a multiple of "
            f"{BLOCKSIZE})"
        )
    if not x.is_floating_point():
        raise ValueError(f"{name}: kbit quantizes floating-point tensors, got {x.dtype}")
    return x.reshape(-1, BLOCKSIZE)


def quantize(
    x: torch.Tensor,
    bits: int,
    codebook: torch.Tensor | None = None,
    name: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., n]`` (n a multiple of 32, any float dtype) -> ``(planes int32 [..., n/32,
    bits], absmax uint8 [..., n/32])`` on x's device; `codebook` defaults to the normal-float
    one. Errors name `name`."""
    check_bits(bits)
    cb = normal_float_codebook(bits) if codebook is None else check_codebook(codebook, bits)
    blocks = _blocks(x, name)
    planes, codes = [], []
    rows = max(1, _CHUNK // BLOCKSIZE)
    for start in range(0, blocks.shape[0], rows):
        chunk = blocks[start : start + rows].to(torch.float32)
        absmax = chunk.abs().amax(-1)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError(f"{name}: kbit cannot quantize non-finite values (inf / nan)")
        code = encode_e4m4(absmax, f"{name} absmax")
        scale = decode_e4m4(code)
        normalized = chunk / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
        planes.append(pack_bitplanes(nearest_level(normalized, cb), bits))
        codes.append(code)
    lead = x.shape[:-1] + (x.shape[-1] // BLOCKSIZE,)
    return torch.cat(planes).reshape(*lead, bits), torch.cat(codes).reshape(lead)


def dequantize(
    planes: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``planes int32 [..., B, bits]``, ``absmax uint8 [..., B]`` -> ``[..., 32 B]`` in `dtype`
    (computed in float32)."""
    bits = planes.shape[-1]
    check_shapes(planes, absmax, bits)
    cb = check_codebook(codebook, bits).to(planes.device)
    values = cb[unpack_bitplanes(planes).long()] * decode_e4m4(absmax).unsqueeze(-1)
    return values.reshape(*absmax.shape[:-1], absmax.shape[-1] * BLOCKSIZE).to(dtype)


def check_shapes(
    planes: torch.Tensor, absmax: torch.Tensor, bits: int, name: str = "kbit weight"
) -> None:
    """Planes ``[..., B, bits]`` int32 and absmax ``[..., B]`` uint8 that belong together."""
    if planes.dtype != torch.int32:
        raise ValueError(f"{name}: kbit_planes are int32 words, got {planes.dtype}")
    if absmax.dtype != torch.uint8:
        raise ValueError(f"{name}: kbit_absmax are uint8 E4M4 codes, got {absmax.dtype}")
    if (
        planes.dim() < 2
        or planes.shape[-1] != bits
        or tuple(planes.shape[:-1]) != tuple(absmax.shape)
    ):
        raise ValueError(
            f"{name}: kbit_planes {list(planes.shape)} and kbit_absmax {list(absmax.shape)} do "
            f"not fit {bits}-bit blocks (planes [..., blocks, {bits}], absmax [..., blocks])"
        )
