"""Runs a straight-line inline-PTX block on the CPU, element-wise over int64 tensors, for the
instruction subset the decode kernels' inline PTX uses: mov, and, or, shl, shr, sub, prmt
(default and sign-replicate selectors), lop3, bfe.u32, bfi.b32, mad.lo.u32, setp.lt.u32 /
selp, cvt.f32.f16, fma.rn.{f16x2,bf16x2} (each half rounded once, as the hardware does), and
ld.shared.b32 / ld.shared.v2.b32 from a given shared memory. It checks the PTX text that
`tl.inline_asm_elementwise` hands to ptxas, not a re-implementation of it."""

from __future__ import annotations

import re

import torch

_MASK32 = 0xFFFFFFFF


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    src = torch.stack([(v >> (8 * i)) & 0xFF for v in (a, b) for i in range(4)], -1)
    out = torch.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src.gather(-1, (nib & 7).unsqueeze(-1)).squeeze(-1)
        byte = torch.where(nib >= 8, torch.where(byte >= 0x80, 0xFF, 0), byte)
        out = out | (byte << (8 * i))
    return out


def _lop3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, lut: int) -> torch.Tensor:
    out = torch.zeros_like(a)
    for bit in range(8):  # minterm bit of (a, b, c) = (0xF0, 0xCC, 0xAA) bits
        if lut >> bit & 1:
            ta = a if bit & 4 else ~a
            tb = b if bit & 2 else ~b
            tc = c if bit & 1 else ~c
            out = out | (ta & tb & tc)
    return out & _MASK32


def _half(v: torch.Tensor, h: int, dtype: torch.dtype) -> torch.Tensor:
    return ((v >> (16 * h)) & 0xFFFF).to(torch.int16).view(dtype).to(torch.float64)


def _halves_fma(a, b, c, dtype: torch.dtype) -> torch.Tensor:
    """Per 16-bit half: a * b + c in float64 (exact: the product of two halves is, and the
    decodes add only -0), rounded once to `dtype`."""
    out = torch.zeros_like(a)
    for h in (0, 1):
        exact = _half(a, h, dtype) * _half(b, h, dtype) + _half(c, h, dtype)
        r = exact.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
        out = out | (r << (16 * h))
    return out


def run(
    asm: str,
    operands: dict[int, torch.Tensor],
    outputs: int,
    shared: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Execute `asm` with ``$i`` = ``operands[i]`` (int64 tensors of 32-bit values, one shape);
    returns ``$0 .. $(outputs - 1)``. ``shared``: the 32-bit words of shared memory (int64,
    word i at byte address 4 i) that ``ld.shared`` reads."""
    shape = next(iter(operands.values())).shape
    regs: dict[str, torch.Tensor] = {f"${i}": v & _MASK32 for i, v in operands.items()}

    def val(tok: str) -> torch.Tensor:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return torch.full(shape, int(tok, 0) & _MASK32, dtype=torch.int64)
        raise KeyError(f"ptx_exec: {tok!r} read before it was written")

    body = asm.strip()
    if body.startswith("{") and body.endswith("}"):  # the block's scope braces
        body = body[1:-1]
    body = re.sub(r"\.reg\s+[^;]+;", "", body)
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt:
            continue
        op, _, rest = stmt.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^{]*})", rest)]
        if op.startswith("ld.shared"):  # [t]: a byte address, 4-aligned
            at = val(args[1].strip("[] ")) // 4
            dests = [t.strip() for t in args[0].strip("{} ").split(",")]
            assert op in ("ld.shared.b32", "ld.shared.v2.b32") and shared is not None, op
            for i, d in enumerate(dests):
                regs[d] = shared[at + i]
            continue
        if op == "mov.b32" and args[0].startswith("{"):  # unpack into two 16-bit registers
            lo, hi = (t.strip() for t in args[0].strip("{} ").split(","))
            v = val(args[1])
            regs[lo], regs[hi] = v & 0xFFFF, (v >> 16) & 0xFFFF
            continue
        d, srcs = args[0], args[1:]
        if op == "mov.b32":
            r = val(srcs[0])
        elif op == "and.b32":
            r = val(srcs[0]) & val(srcs[1])
        elif op == "or.b32":
            r = val(srcs[0]) | val(srcs[1])
        elif op == "shl.b32":
            r = (val(srcs[0]) << val(srcs[1])) & _MASK32
        elif op in ("shr.b32", "shr.u32"):
            r = val(srcs[0]) >> val(srcs[1])
        elif op == "sub.u32":
            r = (val(srcs[0]) - val(srcs[1])) & _MASK32
        elif op == "mad.lo.u32":
            r = (val(srcs[0]) * val(srcs[1]) + val(srcs[2])) & _MASK32
        elif op == "bfe.u32":
            r = (val(srcs[0]) >> val(srcs[1])) & ((1 << val(srcs[2])) - 1)
        elif op == "bfi.b32":  # d = b with bits pos .. pos + len - 1 taken from a's low bits
            a, b, pos, n = (val(t) for t in srcs)
            field = ((1 << n) - 1) << pos
            r = (b & ~field | (a << pos) & field) & _MASK32
        elif op == "prmt.b32":
            r = _prmt(val(srcs[0]), val(srcs[1]), val(srcs[2]))
        elif op == "lop3.b32":
            r = _lop3(val(srcs[0]), val(srcs[1]), val(srcs[2]), int(srcs[3], 0))
        elif op == "setp.lt.u32":
            r = (val(srcs[0]) < val(srcs[1])).to(torch.int64)
        elif op == "selp.b32":
            r = torch.where(val(srcs[2]) != 0, val(srcs[0]), val(srcs[1]))
        elif op == "cvt.f32.f16":
            f = (val(srcs[0]) & 0xFFFF).to(torch.int16).view(torch.float16).to(torch.float32)
            r = f.view(torch.int32).to(torch.int64) & _MASK32
        elif op in ("fma.rn.f16x2", "fma.rn.bf16x2"):
            dtype = torch.float16 if op == "fma.rn.f16x2" else torch.bfloat16
            r = _halves_fma(*(val(s) for s in srcs), dtype)
        else:
            raise NotImplementedError(f"ptx_exec: {op}")
        regs[d] = r
    return [regs[f"${i}"] for i in range(outputs)]
