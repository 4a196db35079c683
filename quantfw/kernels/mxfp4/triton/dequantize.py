"""Whole MXFP4 experts to the activation dtype (the prefill path: a dense grouped GEMM then runs
on tensor cores), from the runtime layout of `mxfp4.layout`, in input order.

A program decodes whole int32 words of ``qweight``: word ``16 q + 4 j + r`` of a row holds the
8 consecutive inputs ``128 q + 32 r + 8 j + (0..7)`` of block ``4 q + r`` as nibbles, lowest
first, so each word becomes 16 contiguous output bytes. The words are loaded in input order (a
permutation within each quad's 64 bytes), so a row's stores are contiguous. For bfloat16 a
word is decoded two values per instruction by `E2M1_WORD_BF16_ASM` (the tests run its PTX on
the CPU, ``tests/support/ptx_exec.py``); other dtypes (and Triton's interpreter) decode each nibble with the
grouped GEMM's float32 arithmetic. Either way each value is ``ldexp(e2m1, s - 127)`` rounded
once, as `mxfp4.dequantize` computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantfw.kernels.mxfp4.triton.grouped_gemm import _e2m1_times_two, _ue8m0_half

#: rows x 8-input chunks per program (the fastest of six on GPT-OSS-20B's experts, H100)
BLOCK_N, BLOCK_W, NUM_WARPS = 8, 128, 4
#: bf16x2 constants: 2**127, and -0.0 as the FMA addend (x * y + -0.0 keeps the sign of zero)
_BF16_2P127, _BF16_NEG_ZERO = 0x7F007F00, 0x80008000


def e2m1_word_bf16_asm(word: int, scale: int) -> str:
    """Inline PTX decoding one int32 word of 8 E2M1 codes (operand ``$word``) under its UE8M0
    byte s (``$scale``) into the bf16 pairs of values (0, 1), (2, 3), (4, 5), (6, 7) in
    ``$0..$3``.

    Each 16-bit half of q holds a code in its top nibble (bits 12..15): its sign stays at bit
    15 and its magnitude bits move under bf16's exponent field (bits 6..8), which is the bf16 of
    value * 2**-126 (codes 0, 1 as subnormals); shifting q left by 4 brings the next pair (codes
    i and i + 4 of the word, i = 3, 2, 1, 0). Each pair is multiplied by 2**127 and by 2**(s -
    128) (both exact bf16 numbers, s = 0, 1 subnormal), so the product rounds once as float32's
    (2 * value) * 2**(s - 128) does; prmt then puts the values back in input order."""
    s = f"${scale}"
    return (
        "{ .reg .b32 q, s, t, u, r0, r1, r2, r3, big, nz; .reg .pred p;\n"
        f"mov.b32 q, ${word};\n"
        f"sub.u32 t, {s}, 1; shl.b32 t, t, 7; mov.b32 u, 0x20; shl.b32 u, u, {s};\n"
        f"setp.lt.u32 p, {s}, 2; selp.b32 t, u, t, p; prmt.b32 s, t, 0, 0x1010;\n"
        f"mov.b32 big, {_BF16_2P127:#x}; mov.b32 nz, {_BF16_NEG_ZERO:#x};\n"
        + "".join(
            f"and.b32 t, q, 0x70007000; shr.u32 t, t, 6; and.b32 u, q, 0x80008000;"
            f" or.b32 r{i}, t, u; shl.b32 q, q, 4; fma.rn.bf16x2 r{i}, r{i}, big, nz;"
            f" fma.rn.bf16x2 r{i}, r{i}, s, nz;\n"
            for i in (3, 2, 1, 0)
        )
        + "prmt.b32 $0, r0, r1, 0x5410; prmt.b32 $1, r2, r3, 0x5410;\n"
        "prmt.b32 $2, r0, r1, 0x7632; prmt.b32 $3, r2, r3, 0x7632; }"
    )


#: $0..$3 the word's values as bf16 pairs; $4 the word; $5 its UE8M0 byte
E2M1_WORD_BF16_ASM = tl.constexpr(e2m1_word_bf16_asm(4, 5))
_ASM_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,r,r")


@triton.jit
def _decode_word_bf16(words, s, BN: tl.constexpr, BW: tl.constexpr):
    """[BN, BW] words and their UE8M0 bytes (int32) -> [BN, BW, 4] int32 pairs of bf16."""
    o0, o1, o2, o3 = tl.inline_asm_elementwise(
        E2M1_WORD_BF16_ASM, _ASM_CONSTRAINTS, [words, s],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
    )  # fmt: skip
    # tl.join adds the lowest index: value 2b + c sits at [b, c] of the nested joins
    return tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [BN, BW, 4])


@triton.jit
def _decode_word(words, s, out_ty: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    """[BN, BW] words and their UE8M0 bytes (int32) -> [BN, BW, 8] values in `out_ty`."""
    f = _ue8m0_half(s)  # value 4a + 2b + c at [a, b, c] of the nested joins
    even = tl.join(_pair(words, 0, 4, f, out_ty), _pair(words, 2, 6, f, out_ty))
    odd = tl.join(_pair(words, 1, 5, f, out_ty), _pair(words, 3, 7, f, out_ty))
    return tl.reshape(tl.join(even, odd), [BN, BW, 8])


@triton.jit
def _pair(words, t0: tl.constexpr, t1: tl.constexpr, f, out_ty: tl.constexpr):
    """Codes t0 and t1 of each word, decoded, as [..., 2]."""
    a = _e2m1_times_two((words >> (4 * t0)) & 15) * f
    b = _e2m1_times_two((words >> (4 * t1)) & 15) * f
    return tl.join(a.to(out_ty), b.to(out_ty))


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, out_ptr, N, K, N_PAD, WPR, GP,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BF16_ASM: tl.constexpr,
):  # fmt: skip
    """grid (E, N / BLOCK_N, WPR / BLOCK_W): out [E, N, K] (int32 pairs of bf16 with BF16_ASM)
    from qweight int32 [E, N_pad, WPR] and scales [E, N_pad, GP]."""
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)  # 8-input chunks, in input order
    quad, r, j = c // 16, (c // 4) % 4, c % 4
    w = 16 * quad + 4 * j + r  # the word holding chunk c: inputs 8 c .. 8 c + 7
    k0 = 8 * c
    loaded = (n < N)[:, None] & (w < WPR)[None, :]  # padded words decode to zeros, not stored
    row = e * N_PAD + n.to(tl.int64)[:, None]
    words = tl.load(q_ptr + row * WPR + w[None, :], mask=loaded, other=0)
    s = tl.load(s_ptr + row * GP + (4 * quad + r)[None, :], mask=loaded, other=0).to(tl.int32)
    if BF16_ASM:
        per_word: tl.constexpr = 4
        vals = _decode_word_bf16(words, s, BLOCK_N, BLOCK_W)
    else:
        per_word: tl.constexpr = 8
        vals = _decode_word(words, s, out_ptr.dtype.element_ty, BLOCK_N, BLOCK_W)
    start = ((e * N + n.to(tl.int64)[:, None]) * K + k0[None, :]) // (8 // per_word)
    t = tl.arange(0, per_word)[None, None, :]
    ok = loaded & (k0 < K)[None, :]
    tl.store(out_ptr + start[:, :, None] + t, vals, mask=ok[:, :, None])


def dequantize(weights, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`grouped.Mxfp4Weights` of experts [E, n, k] -> ``[E, n, k]`` in `dtype` (into `out`,
    contiguous, if given), as `mxfp4.dequantize` computes it from the checkpoint's bytes."""
    w = weights.grouped()
    e, n, k = w.shape
    wpr, gp = w.qweight.shape[-1], w.scales.shape[-1]
    if out is None:
        out = torch.empty(e, n, k, dtype=dtype, device=w.qweight.device)
    elif out.shape != (e, n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"MXFP4 dequantize: out must be a contiguous {dtype} [{e}, {n}, {k}], got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    asm = dtype == torch.bfloat16 and out.is_cuda and k % 2 == 0
    grid = (e, triton.cdiv(n, BLOCK_N), triton.cdiv(wpr, BLOCK_W))
    _dequantize_kernel[grid](
        w.qweight, w.scales, out.view(torch.int32) if asm else out, n, k,
        w.scales.shape[-2], wpr, gp, BLOCK_N=BLOCK_N, BLOCK_W=BLOCK_W, BF16_ASM=asm,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
