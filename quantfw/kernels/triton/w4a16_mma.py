"""Gluon kernel for W4A16 at small M: dequantize in registers straight into mma fragments.

Layout (built once by ``pack_mma`` / ``pack_mma_scales`` in quantfw/kernels/w4a16.py; docs/kernels-w4a16.md):

* ``qf`` int32 ``[N/64, K/16, 32, 4]``: the 32-bit word ``j`` of lane ``l = 4*g + c`` in block
  ``(nb, kb)`` holds, for ``n0 = 64*nb + 16*j + g`` and ``n1 = n0 + 8``, the 8 values an
  ``mma.m16n8k16`` B fragment needs from that lane for the two 8-column tiles ``n0``, ``n1``:
  nibble ``s`` (bits ``4s``) = ``q[16*kb + 8*e + 2*c + h, n0 + 8*t]`` with ``s = 4h + 2t + e``.
  So ``lop3(w >> 4p, 0x000F000F, magic)`` (p = 0..3) is register ``e = p % 2`` of tile ``t = p // 2``.
* ``sz`` int32 ``[n_groups, N/64, 8, 8]``: ``[grp, nb, g, 2*j + t]`` = scale (low half) and
  ``magic + zero`` (high half) of column ``n0 + 8t`` in the activation dtype.

Each lane loads its 4 words of a k16 step with one 128-bit load and its x fragment with four
32-bit loads; per word: 3 shifts, 4 ``lop3``, 4 ``sub`` + 4 ``mul`` (x2 vectors) and two
``mma.sync`` (``m16n8k16``, fp32 accumulate).  Each warp owns one 64-column block and one
16-row tile; CTAs of a split-K grid add into an fp32 workspace and the last one to arrive (a
counter per CTA tile) writes the result and zeroes the workspace and its counter, so one
launch does the whole matmul and the buffers are clean for the next call (or graph replay).

The Gluon layouts are explicit: ``L3`` gives every thread 4 consecutive elements ("a bundle")
of a ``[W, 32, 4]`` tensor (warp, lane, register), so the inline PTX sees the registers it
expects.  A wrong assumption here gives wrong numbers, which the GPU tests check.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

FP16_MAGIC = 0x64006400  # fp16 1024.0 in both halves: (magic | q) = 1024 + q
BF16_MAGIC = 0x43004300  # bf16 128.0


@constexpr_function
def _deq_asm(j: int, is_bf16: bool) -> str:
    """PTX for word ``j`` of the weight bundle ($4..$7) with its scale/zero bundle ($8..$11).

    Outputs $0..$3: the B-fragment registers (tile 0: k 0-7, k 8-15; tile 1: same)."""
    magic = BF16_MAGIC if is_bf16 else FP16_MAGIC
    sz0 = 8 + 2 * (j % 2)
    if is_bf16:  # bf16x2 sub/mul need sm_90; fma.rn.bf16x2 (sm_80) with z negated, -0.0 addend

        def sub(d, z):
            return f"fma.rn.bf16x2 {d}, {d}, one, {z};"

        def mul(d, s_):
            return f"fma.rn.bf16x2 {d}, {d}, {s_}, nzero;"

        negate = (
            ".reg .b32 one, nzero; mov.b32 one, 0x3f803f80; mov.b32 nzero, 0x80008000;\n"
            "xor.b32 z0, z0, nzero; xor.b32 z1, z1, nzero;\n"
        )
    else:

        def sub(d, z):
            return f"sub.f16x2 {d}, {d}, {z};"

        def mul(d, s_):
            return f"mul.f16x2 {d}, {d}, {s_};"

        negate = ""
    return (
        "{ .reg .b32 q, z0, s0, z1, s1;\n"
        f"mov.b32 q, ${4 + j};\n"
        f"prmt.b32 s0, ${sz0}, 0, 0x1010; prmt.b32 z0, ${sz0}, 0, 0x3232;\n"
        f"prmt.b32 s1, ${sz0 + 1}, 0, 0x1010; prmt.b32 z1, ${sz0 + 1}, 0, 0x3232;\n"
        + negate
        + f"lop3.b32 $0, q, 0x000f000f, {magic:#x}, 0xea; shr.u32 q, q, 4;\n"
        f"lop3.b32 $1, q, 0x000f000f, {magic:#x}, 0xea; shr.u32 q, q, 4;\n"
        f"lop3.b32 $2, q, 0x000f000f, {magic:#x}, 0xea; shr.u32 q, q, 4;\n"
        f"lop3.b32 $3, q, 0x000f000f, {magic:#x}, 0xea;\n"
        f"{sub('$0', 'z0')} {mul('$0', 's0')}\n"
        f"{sub('$1', 'z0')} {mul('$1', 's0')}\n"
        f"{sub('$2', 'z1')} {mul('$2', 's1')}\n"
        f"{sub('$3', 'z1')} {mul('$3', 's1')} }}"
    )


def _mma_asm(is_bf16: bool) -> str:
    """Two m16n8k16 mmas sharing the A fragment ($8..$11) with the B registers $12..$15.

    Outputs $0..$3 (tile 0) and $4..$7 (tile 1); accumulators in $16..$19 and $20..$23."""
    t = "bf16" if is_bf16 else "f16"
    op = f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"
    return (
        f"{op} {{$0, $1, $2, $3}}, {{$8, $9, $10, $11}}, {{$12, $13}}, {{$16, $17, $18, $19}};\n"
        f"{op} {{$4, $5, $6, $7}}, {{$8, $9, $10, $11}}, {{$14, $15}}, {{$20, $21, $22, $23}};"
    )


_DEQ_CONSTRAINTS = "=r,=r,=r,=r," + ",".join(["r"] * 8)
_MMA_CONSTRAINTS = ",".join(["=f"] * 8) + "," + ",".join(["r"] * 8) + "," + ",".join(["f"] * 8)
DEQ_CONSTRAINTS = gl.constexpr(_DEQ_CONSTRAINTS)
MMA_CONSTRAINTS = gl.constexpr(_MMA_CONSTRAINTS)
MMA_FP16 = gl.constexpr(_mma_asm(False))
MMA_BF16 = gl.constexpr(_mma_asm(True))


@gluon.jit
def _word(wb, szb, a, c0, c1, J: gl.constexpr, IS_BF16: gl.constexpr):
    """Dequantize word J of the bundle and accumulate its two 16x8 tiles into (c0, c1)."""
    deq: gl.constexpr = _deq_asm(J, IS_BF16)
    b = gl.inline_asm_elementwise(
        deq, DEQ_CONSTRAINTS, [wb, szb], dtype=gl.int32, is_pure=True, pack=4
    )
    mma: gl.constexpr = MMA_BF16 if IS_BF16 else MMA_FP16
    return gl.inline_asm_elementwise(
        mma, MMA_CONSTRAINTS, [a, b, c0, c1], dtype=(gl.float32, gl.float32), is_pure=True, pack=4
    )


@gluon.jit
def _load_chunk(
    qf_ptr, x_ptr, sz_ptr, kb0, w_off, x_off, x_k, x_mask, sz_off, nb_ok, KB, K2, NB,
    CH: gl.constexpr, GKB: gl.constexpr,
):  # fmt: skip
    """Issue every load of one chunk (CH k16 steps): weight and x bundles, scale/zero words."""
    wbs = ()
    xs = ()
    szs = ()
    for u in gl.static_range(CH):
        kb = kb0 + u
        ok = nb_ok & (kb < KB)
        wbs = wbs + (gl.load(qf_ptr + w_off + kb * 128, mask=ok, other=0),)
        xs = xs + (gl.load(x_ptr + x_off + kb * 8, mask=x_mask & (x_k + kb * 8 < K2), other=0),)
        if u % GKB == 0:
            szp = sz_ptr + (kb // GKB) * (NB * 64) + sz_off
            szs = szs + (gl.load(szp, mask=ok, other=0),)
            szs = szs + (gl.load(szp + 4, mask=ok, other=0),)
    return wbs, xs, szs


@gluon.jit
def _store_tile(
    acc,
    out_ptr,
    ws_ptr,
    bias_ptr,
    m,
    n,
    mask,
    N,
    stride_om,
    SPLIT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    mask = mask & (n < N)
    if SPLIT == 1:
        v = acc
    else:  # read the finished sum and leave zeros for the next call
        v = gl.atomic_xchg(ws_ptr + m * N + n, gl.zeros_like(acc), mask=mask, sem="relaxed")
    if HAS_BIAS:
        v += gl.load(bias_ptr + n, mask=mask, other=0.0).to(gl.float32)
    gl.store(out_ptr + m * stride_om + n, v.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _add_tile(acc, ws_ptr, m, n, mask, N):
    gl.atomic_add(ws_ptr + m * N + n, acc, mask=mask & (n < N), sem="relaxed")


@gluon.jit
def w4a16_mma_kernel(
    x_ptr,  # int32 view of x [M, K/2] (pairs of activations)
    qf_ptr,  # int32 [N/64, K/16, 32, 4]
    sz_ptr,  # int32 [n_groups, N/64, 8, 8]
    bias_ptr,
    out_ptr,  # [M, N], x's dtype
    ws_ptr,  # fp32 [>= M*N] zeros (split-K only)
    cnt_ptr,  # int32 [>= grid(0) * grid(1)] zeros (split-K only)
    M,
    N,  # true output features (stores are masked to them)
    K2,  # true input features / 2 (x pairs)
    NB,  # padded N / 64
    KB,  # padded K / 16
    n_iter,  # chunks per warp
    stride_xm,  # in int32 units
    stride_om,
    W: gl.constexpr,  # warps per CTA, one 64-column block each
    CH: gl.constexpr,  # k16 steps per chunk
    GKB: gl.constexpr,  # k16 steps per quantization group
    SPLIT: gl.constexpr,  # CTAs per output tile along K
    PIPE: gl.constexpr,  # prefetch the next chunk while computing this one
    HAS_BIAS: gl.constexpr,
    IS_BF16: gl.constexpr,
):
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    mt = gl.program_id(1)
    sp = gl.program_id(2)

    warp = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    reg = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    nb = gl.program_id(0) * W + gl.expand_dims(gl.expand_dims(warp, 1), 2)
    l3 = gl.expand_dims(gl.expand_dims(lane, 0), 2)
    r3 = gl.expand_dims(gl.expand_dims(reg, 0), 1)
    g = l3 // 4
    c = l3 % 4
    nb_ok = nb < NB

    # A fragment (x rows m, k pairs): a0 (g, 2c), a1 (g+8, 2c), a2 (g, 2c+8), a3 (g+8, 2c+8)
    xm = mt * 16 + g + 8 * (r3 % 2)
    x_k = c + 4 * (r3 // 2)
    x_off = xm * stride_xm + x_k
    x_mask = xm < M
    w_off = nb * (KB * 128) + l3 * 4 + r3
    sz_off = nb * 64 + g * 8 + r3

    c00 = gl.zeros([W, 32, 4], gl.float32, L3)
    c01 = gl.zeros([W, 32, 4], gl.float32, L3)
    c10 = gl.zeros([W, 32, 4], gl.float32, L3)
    c11 = gl.zeros([W, 32, 4], gl.float32, L3)
    c20 = gl.zeros([W, 32, 4], gl.float32, L3)
    c21 = gl.zeros([W, 32, 4], gl.float32, L3)
    c30 = gl.zeros([W, 32, 4], gl.float32, L3)
    c31 = gl.zeros([W, 32, 4], gl.float32, L3)
    # PIPE: the next chunk's loads are in flight while this one is computed (more registers)
    wbs, xs, szs = _load_chunk(
        qf_ptr,
        x_ptr,
        sz_ptr,
        sp * CH,
        w_off,
        x_off,
        x_k,
        x_mask,
        sz_off,
        nb_ok,
        KB,
        K2,
        NB,
        CH,
        GKB,
    )
    for i in range(n_iter):
        if PIPE:
            kb_next = ((i + 1) * SPLIT + sp) * CH
        else:
            kb_next = (i * SPLIT + sp) * CH
        nwbs, nxs, nszs = _load_chunk(
            qf_ptr, x_ptr, sz_ptr, kb_next, w_off, x_off, x_k, x_mask, sz_off, nb_ok, KB, K2,
            NB, CH, GKB,
        )  # fmt: skip
        if not PIPE:
            wbs = nwbs
            xs = nxs
            szs = nszs
        for u in gl.static_range(CH):
            wb = wbs[u]
            a = xs[u]
            szl = szs[2 * (u // GKB)]
            szh = szs[2 * (u // GKB) + 1]
            c00, c01 = _word(wb, szl, a, c00, c01, 0, IS_BF16)
            c10, c11 = _word(wb, szl, a, c10, c11, 1, IS_BF16)
            c20, c21 = _word(wb, szh, a, c20, c21, 2, IS_BF16)
            c30, c31 = _word(wb, szh, a, c30, c31, 3, IS_BF16)
        wbs = nwbs
        xs = nxs
        szs = nszs

    # C fragment: c0 (g, 2c), c1 (g, 2c+1), c2 (g+8, 2c), c3 (g+8, 2c+1) of each 16x8 tile;
    # tile t of word j covers columns 64 nb + 16 j + 8 t + (0..7)
    m = mt * 16 + g + 8 * (r3 // 2)
    n = nb * 64 + 2 * c + r3 % 2
    mask = m < M  # per row; each tile adds its own column bound
    if SPLIT > 1:
        _add_tile(c00, ws_ptr, m, n, mask, N)
        _add_tile(c01, ws_ptr, m, n + 8, mask, N)
        _add_tile(c10, ws_ptr, m, n + 16, mask, N)
        _add_tile(c11, ws_ptr, m, n + 24, mask, N)
        _add_tile(c20, ws_ptr, m, n + 32, mask, N)
        _add_tile(c21, ws_ptr, m, n + 40, mask, N)
        _add_tile(c30, ws_ptr, m, n + 48, mask, N)
        _add_tile(c31, ws_ptr, m, n + 56, mask, N)
        gl.thread_barrier()
        cnt = cnt_ptr + gl.program_id(0) * gl.num_programs(1) + mt
        ticket = gl.atomic_add(cnt, 1, sem="acq_rel")
        last = ticket == SPLIT - 1
        gl.atomic_xchg(cnt, 0, mask=last, sem="relaxed")
        mask = mask & last
    _store_tile(c00, out_ptr, ws_ptr, bias_ptr, m, n, mask, N, stride_om, SPLIT, HAS_BIAS)
    _store_tile(c01, out_ptr, ws_ptr, bias_ptr, m, n + 8, mask, N, stride_om, SPLIT, HAS_BIAS)
    _store_tile(c10, out_ptr, ws_ptr, bias_ptr, m, n + 16, mask, N, stride_om, SPLIT, HAS_BIAS)
    _store_tile(c11, out_ptr, ws_ptr, bias_ptr, m, n + 24, mask, N, stride_om, SPLIT, HAS_BIAS)
    _store_tile(c20, out_ptr, ws_ptr, bias_ptr, m, n + 32, mask, N, stride_om, SPLIT, HAS_BIAS)
    _store_tile(c21, out_ptr, ws_ptr, bias_ptr, m, n + 40, mask, N, stride_om, SPLIT, HAS_BIAS)
    _store_tile(c30, out_ptr, ws_ptr, bias_ptr, m, n + 48, mask, N, stride_om, SPLIT, HAS_BIAS)
    _store_tile(c31, out_ptr, ws_ptr, bias_ptr, m, n + 56, mask, N, stride_om, SPLIT, HAS_BIAS)


# ---------------------------------------------------------------------------------------------
# host side

_WORKSPACE: dict[int, tuple] = {}
_NUM_SMS: dict[int, int] = {}


def _num_sms(device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _workspace(device, n_ws: int, n_cnt: int):
    """Zeroed fp32 partial sums and int32 arrival counters, shared by all calls on a device.

    Every split-K launch leaves them zeroed again (the last CTA of a tile resets its part), so
    they are allocated once; calls on one device must be stream-ordered (as a model's are), and
    every shape should be run once before CUDA-graph capture so that no buffer grows inside it."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ws, cnt = _WORKSPACE.get(idx, (None, None))
    if ws is None or ws.numel() < n_ws or cnt.numel() < n_cnt:
        n_ws = max(n_ws, 0 if ws is None else ws.numel())
        n_cnt = max(n_cnt, 0 if cnt is None else cnt.numel())
        ws = torch.zeros(n_ws, device=device, dtype=torch.float32)
        cnt = torch.zeros(n_cnt, device=device, dtype=torch.int32)
        _WORKSPACE[idx] = (ws, cnt)
    return ws, cnt


def plan(M: int, N: int, K: int, device, warps: int = 4, chunk: int = 8, ctas_per_sm: int = 4):
    """(split, n_iter): CTAs per output tile along K, and chunks (of ``chunk`` k16 steps) per warp.

    The fewest chunks per warp that keeps the grid within ``ctas_per_sm`` CTAs per SM."""
    return _plan(M, N, K, _num_sms(device), warps, chunk, ctas_per_sm)


@functools.lru_cache(maxsize=4096)
def _plan(M: int, N: int, K: int, sms: int, warps: int, chunk: int, ctas_per_sm: int):
    chunks = triton.cdiv(K // 16, chunk)
    tiles = triton.cdiv(N // 64, warps) * triton.cdiv(M, 16)
    target = ctas_per_sm * sms
    n_iter = 1
    while n_iter < chunks and tiles * triton.cdiv(chunks, n_iter) > target:
        n_iter *= 2
    split = triton.cdiv(chunks, n_iter)
    n_iter = triton.cdiv(chunks, split)
    return split, n_iter


def w4a16_mma_matmul(
    x2: torch.Tensor,
    qf: torch.Tensor,
    sz: torch.Tensor,
    N: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    warps: int = 4,
    chunk: int = 8,
    ctas_per_sm: int = 4,
    pipe: bool = False,
) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W (+ bias); x2 fp16/bf16 on CUDA, K even.

    ``qf``/``sz``: pack_mma / pack_mma_scales tensors (padded to 16 x 64), ``sz`` in x's dtype."""
    M, K = x2.shape
    NB, KB = qf.shape[:2]
    if x2.stride(1) != 1 or x2.stride(0) % 2:
        x2 = x2.contiguous()
    if x2.data_ptr() % 4:  # read as int32 pairs
        x2 = x2.clone()
    if group_size < K:
        if group_size % 16:
            raise ValueError(f"w4a16 mma kernel: group size {group_size} is not a multiple of 16")
        gkb = group_size // 16
        chunk = chunk if gkb % chunk == 0 or chunk % gkb == 0 else math.gcd(gkb, chunk)
    else:
        gkb = triton.cdiv(KB, chunk) * chunk
    split, n_iter = plan(M, NB * 64, KB * 16, x2.device, warps, chunk, ctas_per_sm)
    mt = triton.cdiv(M, 16)
    out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    grid = (triton.cdiv(NB, warps), mt, split)
    ws, cnt = _workspace(x2.device, M * N if split > 1 else 1, grid[0] * mt)
    has_bias = bias is not None
    w4a16_mma_kernel[grid](
        x2.view(torch.int32), qf, sz, bias if has_bias else out, out, ws, cnt,
        M, N, K // 2, NB, KB, n_iter, x2.stride(0) // 2, out.stride(0),
        W=warps, CH=chunk, GKB=gkb, SPLIT=split, PIPE=pipe, HAS_BIAS=has_bias,
        IS_BF16=x2.dtype == torch.bfloat16, num_warps=warps,
    )  # fmt: skip
    return out
