"""The kbit tiled layout and the CPU path (CI), the Triton kernels in Triton's CPU interpreter
(skipped without triton), and the same kernels on a GPU (marked ``gpu``) against the reference
(`quantfw.kernels.kbit.format`)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from quantfw.kernels import kbit
from quantfw.kernels.kbit import configs as C
from quantfw.kernels.kbit import format as kfmt
from quantfw.kernels.kbit import layout
from quantfw.kernels.kbit import tables as T

INTERPRET_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "kbit_interpret.py")


def random_weight(N: int, K: int, bits: int, seed: int, device="cpu"):
    """(flat planes, absmax, codebook, dense reference [N, K] fp32) of a random N(0, 0.05) weight."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.05
    planes, absmax = kfmt.quantize(w, bits)
    cb = kfmt.normal_float_codebook(bits)
    ref = kfmt.dequantize(planes, absmax, cb)
    return planes.to(device), absmax.to(device), cb.to(device), ref.to(device)


@pytest.mark.parametrize("bits,N,K", [(2, 200, 320), (3, 128, 64), (4, 72, 288), (5, 136, 96)])
def test_field_packed_layout_matches_its_definition(bits, N, K):
    planes, absmax, cb, ref = random_weight(N, K, bits, seed=bits)
    w = layout.repack(planes, absmax, cb)
    KB, KBP, NP = K // 32, -(-K // 256) * 8, -(-N // 128) * 128
    assert w.qweight.shape == (NP, KBP * bits) and w.qweight.dtype == torch.int32
    assert w.scales.shape == (NP, KBP) and w.bits == bits
    indices = kfmt.unpack_bitplanes(planes)
    q = w.qweight.to(torch.int64) & 0xFFFFFFFF
    # the groups of the module docstring: (field bits, first word, first index bit)
    groups = {2: [(2, 0, 0)], 3: [(2, 0, 0), (1, 2, 2)], 4: [(4, 0, 0)], 5: [(4, 0, 0), (1, 4, 4)]}
    gen = torch.Generator().manual_seed(bits)
    picks = [(0, 0), (N - 1, KB - 1)] + [
        (int(torch.randint(N, (1,), generator=gen)), int(torch.randint(KB, (1,), generator=gen)))
        for _ in range(6)
    ]
    for n, kb in picks:
        assert w.scales[n, kb] == absmax[n, kb]
        for e in range(32):
            idx = 0
            for f, first, low in groups[bits]:
                j = first + e // (32 // f)  # quads: word j of block 4 q + r at 4 bits q + 4 j + r
                word = int(q[n, (kb // 4) * 4 * bits + 4 * j + kb % 4])
                idx |= ((word >> (f * (e % (32 // f)))) & ((1 << f) - 1)) << low
            assert idx == indices[n, kb, e], (n, kb, e)
    words = layout.block_words(w.qweight, bits)
    assert not words[N:].any() and not words[:, KB:].any()  # padding: zero blocks, scale 0
    assert not w.scales[N:].any() and not w.scales[:, KB:].any()
    p2, a2 = layout.unpack(w)
    assert torch.equal(p2, planes) and torch.equal(a2, absmax)
    assert torch.equal(layout.dequantize_weight(w), ref)
    assert torch.equal(layout.dequantize_weight(w, torch.float16), ref.half())
    held = sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.codebook))
    assert layout.tiled_nbytes(N, K, bits) == held


def test_cpu_matmul_matches_reference():
    planes, absmax, cb, ref = random_weight(200, 320, 4, seed=1)
    w = kbit.repack_weight(planes, absmax, cb)
    gen = torch.Generator().manual_seed(2)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(2, 3, 320, generator=gen).to(dtype)
        bias = torch.randn(200, generator=gen).to(dtype)
        out = kbit.kbit_matmul(x, w, bias)
        want = x.double() @ ref.double().t() + bias.double()
        assert out.shape == (2, 3, 200) and out.dtype == dtype
        assert ((out.double() - want).norm() / want.norm()).item() < tol
    with pytest.raises(ValueError, match="x has 64 input features, weight has 320"):
        kbit.kbit_matmul(torch.randn(2, 64), w)
    assert "quantfw.kernels.kbit.triton.dispatch" not in sys.modules


def test_staged_tile16_rule():
    """9-16 tokens run one 16-token tile, TMA-staged and planned for 3 CTAs an SM where the
    launch can be staged and that plan fills the GPU's CTA slots better than the unstaged
    tile's 2 an SM (132 SMs: Qwen3-8B's qkv and gate_up, whose 2-an-SM plans leave 27% of
    the slots empty); unstaged at 2 an SM elsewhere (o: 3 an SM would fill 65%; down: both
    97%)."""
    pytest.importorskip("triton")
    from quantfw.kernels.kbit.triton import mma as KM

    shapes = {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (24576, 4096),
        "down": (4096, 12288),
    }
    staged = {
        name: [KM.staged_tile16(M, n // 64, k // 32, 132, True, 4, 4, 4) for M in (1, 8, 9, 16, 17)]
        for name, (n, k) in shapes.items()
    }
    no, yes = [False] * 5, [False, False, True, True, False]
    assert staged == {"qkv": yes, "o": no, "gate_up": yes, "down": no}
    assert not KM.staged_tile16(12, 96, 128, 132, False, 4, 4, 4)  # cannot be staged
    assert round(KM._wave_fill(96, 128, 1, 132, 4, 4, 4, 2), 3) == 0.727  # 192 CTAs of 264
    assert round(KM._wave_fill(96, 128, 1, 132, 4, 4, 4, 3), 3) == 0.97  # 384 of 396
    assert round(KM._wave_fill(384, 128, 1, 132, 4, 4, 4, 2), 3) == 0.727  # 384 of 2 x 264
    assert round(KM._wave_fill(64, 128, 1, 132, 4, 4, 4, 3), 3) == 0.646  # 256 of 396


def _assert_fits_three_ctas_an_sm(kernel) -> None:
    """A capped 16-token tile's sm_90 compile: at most `TILE16_STAGED_MAXNREG` registers, at
    most 64 bytes of stack, and shared memory for 3 CTAs an SM."""
    from aot import resource_usage

    from quantfw.kernels.kbit.triton import mma as KM

    usage = resource_usage(kernel)
    regs, stack = (int(v) for v in re.search(r"REG:(\d+) STACK:(\d+) ", usage).groups())
    assert regs <= KM.TILE16_STAGED_MAXNREG and stack <= 64, usage
    assert 3 * kernel.metadata.shared <= 228 * 1024


@pytest.mark.parametrize("bits,act", [(4, 0), (4, 1), (2, 0), (2, 1)])
def test_staged_tile16_fits_three_ctas_an_sm_without_a_gpu(bits, act):
    """The staged 16-token tile (`staged_tile16`; K = 2's columns paired, as `pairs_columns`
    launches it) compiled for sm_90 with its register cap: at most `TILE16_STAGED_MAXNREG`
    registers (3 CTAs of 4 warps an SM) and a small spill (the cap measured 32-56 bytes of
    stack; much more would cost the loop its speed), both the split-K launch and gate_up's
    gated epilogue."""
    pytest.importorskip("triton")
    from aot import compile_for_sm90

    from quantfw.kernels.kbit.triton import mma as KM

    consts = dict(W=4, CH=4, TM=16, SPLIT=2 - act, COPIES={2: 16, 4: 32}[bits], BITS=bits,
                  PIPE=False, MASK_N=False, MASK_K=False, HAS_BIAS=False, IS_BF16=False,
                  UE8M0=False, GROUPED=False, GATHER=False, PDL=True, WK=4, ACT=act,
                  LATE_RELEASE=False, TMA=True, S_TMA=True,
                  PAIR=KM.pairs_columns(bits, 16))  # fmt: skip
    kernel = compile_for_sm90(KM.kbit_mma_kernel, _mma_tma_signature(bits), consts, _MMA_ALIGNED,
                              num_warps=4, launch_pdl=True,
                              maxnreg=KM.TILE16_STAGED_MAXNREG)  # fmt: skip
    _assert_fits_three_ctas_an_sm(kernel)


def test_grouped_staged_tile16_fits_three_ctas_an_sm_without_a_gpu():
    """MXFP4's grouped 16-row blocks as `grouped_gemm.LUT16_STAGED_OPTIONS` launch them on
    sm_90 (GPT-OSS's W13: bf16, UE8M0, gathered rows, bias, SwiGLU in the epilogue; weights
    staged by TMA, scales loaded): within the cap and a small spill, 3 CTAs an SM."""
    pytest.importorskip("triton")
    from aot import compile_for_sm90

    from quantfw.kernels.kbit.triton import mma as KM
    from quantfw.kernels.mxfp4.triton.grouped_gemm import LUT16_STAGED_OPTIONS

    consts = dict(W=4, CH=4, TM=16, SPLIT=1, COPIES=32, BITS=4, PIPE=False, MASK_N=False,
                  MASK_K=True, HAS_BIAS=True, IS_BF16=True, UE8M0=True, GROUPED=True,
                  GATHER=True, PDL=True, WK=4, ACT=2, LATE_RELEASE=False, TMA=True,
                  S_TMA=False)  # fmt: skip
    sig = {**_mma_tma_signature(4), "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    kernel = compile_for_sm90(KM.kbit_mma_kernel, sig, consts, _MMA_ALIGNED, num_warps=4,
                              launch_pdl=True, maxnreg=LUT16_STAGED_OPTIONS["maxnreg"])  # fmt: skip
    _assert_fits_three_ctas_an_sm(kernel)


def test_configs_and_their_checks():
    for M in (1, 16, 17, 64, 65, 511, 512, 4096):
        cands = C.candidate_configs(M)
        assert cands[0] == C.default_config(M, 4096, 4096, 4) and len(set(cands)) == len(cands)
        for cfg in cands:
            assert C.check_config(cfg) == cfg
    # few tokens: the mma kernel; then fused; large M: dequantize + cuBLAS
    Ms = (1, 16, 33, 64, 128, 129, 4096)
    kinds = [C.default_config(M, 64, 64, 4)[::7] for M in Ms]
    assert kinds == [("mma",)] * 2 + [("fused", True)] * 2 + [("fused", False), ("deq",), ("deq",)]
    # table copies per lane (one per bank: 32 entries of one word, 16 of two; K = 5's 1024
    # entries 8); CTAs per SM as they fit: 3 for a token tile of 8, 2 for one of 16 and at
    # K = 3, 5 (twice the weight registers)
    mma = [C.default_config(M, N, 4096, b)[3:5] for M, N, b in
           ((1, 24576, 4), (8, 12288, 2), (1, 4096, 4), (9, 24576, 4), (1, 4096, 3),
            (16, 4096, 3), (1, 4096, 5), (16, 4096, 5))]  # fmt: skip
    assert mma == [(3, 32), (3, 16), (3, 32), (2, 32), (2, 32), (2, 32), (2, 8), (2, 8)]
    for bits in (2, 3, 4, 5):
        assert [C.default_config(M, 64, 64, bits)[0] for M in Ms[:3]] == ["mma", "mma", "fused"]
        for M in (1, 16, 64, 4096):
            cands = C.candidate_configs(M, bits)
            assert cands[0] == C.default_config(M, 64, 64, bits) and len(set(cands)) == len(cands)
    for M in (1, 64):  # both MMA orientations are tuning candidates where few tokens run
        assert {c[7] for c in C.candidate_configs(M) if c[0] == "fused"} == {True, False}
        assert any(c[0] == "mma" for c in C.candidate_configs(M, 2))
    with pytest.raises(ValueError, match=r"here: unknown kernel kind 'wg'; kinds: mma, fused, deq"):
        C.check_config(("wg", 1), "here")
    with pytest.raises(ValueError, match="chunk=6 must be 4 or 8 blocks"):
        C.check_config(("mma", 4, 6, 4, 1, False))
    with pytest.raises(ValueError, match="copies=3 must be a power of two <= 32"):
        C.check_config(("mma", 4, 4, 4, 3, False))
    with pytest.raises(ValueError, match="block_n=256 must be 16, 32, 64 or 128"):
        C.check_config(("fused", 16, 256, 64, 4, 2, 4, False))
    with pytest.raises(ValueError, match="block_k=512 must be 128 or 256"):
        C.check_config(("deq", 64, 512, 4))
    with pytest.raises(ValueError, match="block_m=8 must be 16, 32, 64"):
        C.check_config(("fused", 8, 64, 128, 4, 2, 4, True))
    with pytest.raises(ValueError, match=r"swap=1 in .* must be True/False"):
        C.check_config(("fused", 16, 64, 128, 4, 2, 4, 1))
    with pytest.raises(ValueError, match=r"has 6 fields, fused takes \('fused', block_m, .*swap\)"):
        C.check_config(("fused", 16, 64, 64, 4, 2, 4))


def test_tables_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(T.ENV_DIR, str(tmp_path))
    T.TABLES.cache_clear()
    small, big = ("fused", 16, 32, 128, 4, 2, 8, True), ("deq", 128, 128, 8)
    path = tmp_path / T.TABLES.file_name("Fake GPU")
    assert path.name == "kbit-Fake_GPU.json"
    T.TABLES.write_table(path, "Fake GPU", {(640, 256, 3): {1: small, 1024: big}}, "test")
    assert list(json.loads(path.read_text())["shapes"]) == ["N=640,K=256,bits=3"]
    assert T.untuned_config("Fake GPU", 2, 640, 256, 3) == big  # bucket 2 -> tuned M 1024
    assert T.untuned_config("Fake GPU", 1, 640, 256, 3) == small
    assert T.untuned_config("Fake GPU", 1, 640, 256, 4) == C.default_config(1, 640, 256, 4)
    path.write_text('{"shapes": {"N=1,K=2,G=3": {"1": ["deq", 128, 128, 8]}}}')
    T.TABLES.cache_clear()
    with pytest.raises(
        ValueError, match=r"shape key 'N=1,K=2,G=3' is not of the form 'N=<N>,K=<K>,bits=<bits>'"
    ):
        T.TABLES.load_table(path)
    T.TABLES.cache_clear()


def test_shipped_tables_are_valid(monkeypatch):
    """Every shipped table loads (each entry a well-formed config); the H200 one covers
    bench_kbit.py's shapes and token counts at K = 2 and 4 and is what an untuned call there
    gets, but for calls made for CUDA graphs past 16 tokens (the wgmma kernel's rule)."""
    monkeypatch.delenv(T.ENV_DIR, raising=False)
    T.TABLES.cache_clear()
    files = sorted(T.PACKAGE_DIR.glob("kbit-*.json"))
    assert [f.name for f in files] == ["kbit-NVIDIA_H200.json"]
    table = T.TABLES.load_table(files[0])
    assert set(table) == {(n, k, b) for n, k in ((24576, 4096), (4096, 12288)) for b in (2, 4)}
    assert all(set(per_m) == {1, 4, 16, 64, 256, 1024} for per_m in table.values())
    h200 = "NVIDIA H200"
    for bits in (2, 4):
        entry = table[(24576, 4096, bits)]
        assert T.untuned_config(h200, 64, 24576, 4096, bits) == entry[64]
        # calls made for CUDA graphs past 16 tokens: the wgmma kernel's tile by its rule
        assert T.untuned_config(h200, 64, 24576, 4096, bits, True) == ("wgmma", 64, 4, 64)
        assert T.untuned_config(h200, 16, 24576, 4096, bits, True) == entry[16]
    # where the rule has no tile (o's shape at 512 tokens): the table, else the default
    assert T.untuned_config(h200, 512, 4096, 4096, 4, True) == ("deq", 128, 128, 8)
    assert T.untuned_config(h200, 256, 4096, 12288, 4, True) == ("wgmma", 256, 3, 256)
    T.TABLES.cache_clear()


def test_triton_kernels_in_the_interpreter():
    """Repack and dequantize bit-exact, the fused GEMM (split-K 1 and > 1, SWAP off and on,
    M = 1, 3, 17, 40, bias) and the deq path within fp16 rounding, workspace left clean;
    K = 2..5, padded N/K (tests/scripts/kbit_interpret.py)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, INTERPRET_SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )


_GEMM_SIGNATURE = {
    "x_ptr": "*fp16", "qweight_ptr": "*i32", "scales_ptr": "*u8", "codebook_ptr": "*fp32",
    "out_ptr": "*fp16", "bias_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32",
    "N": "i32", "K": "i32", "KBP": "i32", "stride_xm": "i32", "stride_om": "i32",
    "ITERS": "i32", "STEPS": "i32", "BITS": "constexpr", "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr", "SWAP": "constexpr",
    "HAS_BIAS": "constexpr",
}  # fmt: skip
_DEQUANT_SIGNATURE = {
    "qweight_ptr": "*i32", "scales_ptr": "*u8", "codebook_ptr": "*fp32", "w_ptr": "*bf16",
    "N": "i32", "K": "i32", "KBP": "i32", "BITS": "constexpr",
    "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
}  # fmt: skip
_REPACK_SIGNATURE = {
    "planes_ptr": "*i32", "absmax_ptr": "*u8", "qweight_ptr": "*i32", "scales_ptr": "*u8",
    "N": "i32", "KB": "i32", "KBP": "i32", "BITS": "constexpr", "BLOCKS": "constexpr",
}  # fmt: skip


def test_kernels_compile_for_sm90_without_a_gpu():
    """Ahead-of-time compiles (Triton's bundled ptxas, no GPU): what the interpreter does not
    check (constexpr rules, layouts, the select tree and the gather paths, shared memory)."""
    pytest.importorskip("triton")
    from aot import compile_for_sm90

    from quantfw.kernels.kbit.triton import kernels as KK

    def compile_(fn, signature, constexprs, warps=4, stages=2):
        return compile_for_sm90(fn, signature, constexprs, num_warps=warps, num_stages=stages)

    for bits, tile, swap, warps in ((2, (16, 128, 128), True, 8), (5, (64, 64, 128), False, 4)):
        bm, bn, bk = tile
        consts = {"BITS": bits, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": True,
                  "SWAP": swap, "HAS_BIAS": True}  # fmt: skip
        kernel = compile_(KK.kbit_gemm_kernel, _GEMM_SIGNATURE, consts, warps=warps, stages=3)
        assert kernel.metadata.shared <= 228 * 1024
    compile_(KK.kbit_dequant_kernel, _DEQUANT_SIGNATURE, {"BITS": 3, "BLOCK_N": 64, "BLOCK_K": 128})
    compile_(KK.kbit_repack_kernel, _REPACK_SIGNATURE, {"BITS": 4, "BLOCKS": 128})


_MMA_SIGNATURE = {
    "x_ptr": "*i32", "q_ptr": "*i32", "s_ptr": "*i32", "lut_ptr": "*i32", "bias_ptr": "*fp16",
    "out_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "block_expert_ptr": "*i32",
    "block_row_ptr": "*i32", "m_indptr_ptr": "*i64", "gather_ptr": "*i64", "M": "i32",
    "N": "i32", "K2": "i32", "NB": "i32", "KBP": "i32", "KBS": "i32", "n_iter": "i32",
    "num_experts": "i32", "stride_xm": "i32", "stride_om": "i32", "stride_qe": "i32",
    "stride_se": "i32", "stride_be": "i32", "act_alpha": "fp32", "act_limit": "fp32",
}  # fmt: skip
#: pointers and sizes compiled as multiples of 16, as the JIT specialises Qwen3-8B's launches
#: (without it the weight loads come out as 4-byte ones: kbit-lab-log §10)
_MMA_ALIGNED = ("x_ptr", "q_ptr", "s_ptr", "lut_ptr", "out_ptr", "ws_ptr", "K2", "KBP", "KBS",
                "stride_xm", "stride_om")  # fmt: skip


def _mma_tma_signature(bits: int) -> dict[str, str]:
    """`_MMA_SIGNATURE` with the TMA descriptors of a staged launch: weight-word boxes [64 rows,
    a quad's field words] (16 words at K = 4, 5, 8 at K = 2, 3), 1-bit-word and scale boxes
    [64, 4]."""
    from triton.experimental.gluon import language as gl

    slot = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    mw = 16 if bits >= 4 else 8
    return {**_MMA_SIGNATURE, "w_desc": f"tensordesc<i32[64, {mw}],{slot!r}>",
            "o_desc": f"tensordesc<i32[64, 4],{slot!r}>",
            "s_desc": f"tensordesc<i32[64, 4],{slot!r}>"}  # fmt: skip


@pytest.mark.parametrize("bits,tm,copies,mxfp4,wk,act,late", [
    (4, 8, 32, False, 4, 0, False), (2, 16, 1, False, 4, 1, False), (3, 8, 32, False, 1, 0, False),
    (5, 16, 8, False, 2, 0, False), (4, 8, 32, True, 4, 2, False), (4, 16, 16, True, 1, 0, False),
    (4, 16, 32, False, 4, 1, False), (5, 8, 8, False, 4, 1, True), (3, 8, 32, False, 4, 1, True),
])  # fmt: skip
def test_mma_kernel_compiles_for_sm90_without_a_gpu(bits, tm, copies, mxfp4, wk, act, late):
    """The Gluon kernel (inline PTX, which no interpreter runs) through Triton's bundled
    ptxas: its table is the largest shared-memory allocation (``wk`` > 1: padded to the size
    of the warps' partial sums, which reuse it after the loop), so it starts at ``global_smem``.
    ``mxfp4``: the grouped variant with UE8M0 scales and the token gather. With PDL
    (`common.pdl`) it lets the next kernel launch first thing; a dense launch loads its first
    weights and scales and fills its table before its wait, a grouped one waits before its
    first load (its row blocks come from the sort kernels). ``act``: a gated pair's
    activation in the epilogue (no split across CTAs; its two halves of the warps' sums take
    the same shared memory), exp once per output and no atomics. ``late``: the next kernel's
    launch is released only after the last mma (a fused launch of more than one wave)."""
    pytest.importorskip("triton")
    from aot import compile_for_sm90

    from quantfw.kernels.kbit.triton import mma as KM

    consts = dict(W=4, CH=4, TM=tm, SPLIT=1 if act else 2, COPIES=copies, BITS=bits,
                  PIPE=False, MASK_N=True, MASK_K=True, HAS_BIAS=True, IS_BF16=bits == 2,
                  UE8M0=mxfp4, GROUPED=mxfp4, GATHER=mxfp4, PDL=True, WK=wk, ACT=act,
                  LATE_RELEASE=late, TMA=False, w_desc=None, o_desc=None, s_desc=None)  # fmt: skip
    kernel = compile_for_sm90(KM.kbit_mma_kernel, _MMA_SIGNATURE, consts, num_warps=4,
                              launch_pdl=True)  # fmt: skip
    entries = {2: 256, 3: 64, 4: 256, 5: 1024}[bits]
    sums = 4 * (tm // 8) * 4 * 512 if wk > 1 else 0  # [accumulators x warps, 32, 4] fp32
    assert kernel.metadata.shared == max(entries * copies * (2 if bits == 2 else 1) * 4, sums)
    ptx = kernel.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and "ld.shared" in ptx
    # per thread: one exp per output it stores (2 TM // 8: half of its accumulators), none
    # without act
    assert ptx.count("ex2.approx") == (2 * (tm // 8) if act else 0)
    assert bool(re.search(r"\b(atom|red)\.global", ptx)) == (not act)
    # the table's stores: every shared store before the first barrier addresses global_smem
    fill = ptx[: ptx.index("bar.sync")]
    assert re.search(r"\bst(matrix)?\.[.\w]*shared", fill) and "global_smem" in fill
    release = ptx.index("griddepcontrol.launch_dependents")
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("launch_dependents") == 1
    if late:
        assert release > ptx.rindex("mma.sync")
    else:
        assert release < ptx.index("ld.global")
    if mxfp4:
        assert wait < ptx.index("ld.global")
    else:  # 8 weight (16 at K = 3, 5) and 2 scale loads per 4 blocks, the table, the wait
        assert ptx.index("bar.sync") < wait
        assert len(re.findall(r"\bld\.global", ptx[:wait])) >= (18 if bits % 2 else 10)


@pytest.mark.parametrize("bits,grouped,scales", [
    (4, False, True), (4, True, True), (2, False, True), (3, False, False), (5, False, True),
    (4, False, False),
])  # fmt: skip
def test_mma_kernel_tma_staging_compiles_for_sm90_without_a_gpu(bits, grouped, scales):
    """With ``TMA`` (sm_90) the weight words come through shared-memory slots that TMA fills
    with the CTA's next iteration: 4 boxes [64 rows, a quad's field words] (16 words a row at
    K = 4, 5, 8 at K = 2, 3) and at K = 3, 5 4 boxes [64, 4] of 1-bit words; no 16-byte
    register loads of weights are left, the slots sit after the table (which the lookups
    address at ``global_smem``; K = 3's padded to 16 KB), one mbarrier; a dense launch issues
    its first copies before the PDL wait, a grouped one after it (its expert comes from the
    sort). ``scales`` (``S_TMA``): the scale words come by a fifth box [64, 4] into a slot of
    their own, and no global load of a scale is left in the loop (only x's)."""
    pytest.importorskip("triton")
    from aot import compile_for_sm90

    from quantfw.kernels.kbit.triton import mma as KM

    signature = _mma_tma_signature(bits)
    copies = {2: 16, 3: 32, 4: 32, 5: 8}[bits]  # the defaults
    table = {2: 32768, 3: 16384, 4: 32768, 5: 32768}[bits]  # K = 3: 64 entries padded to 128
    consts = dict(W=4, CH=4, TM=8, SPLIT=1 if grouped else 2, COPIES=copies, BITS=bits, PIPE=False,
                  MASK_N=True, MASK_K=True, HAS_BIAS=True, IS_BF16=grouped, UE8M0=grouped,
                  GROUPED=grouped, GATHER=grouped, PDL=True, WK=4, ACT=2 if grouped else 0,
                  LATE_RELEASE=False, TMA=True, S_TMA=scales)  # fmt: skip
    kernel = compile_for_sm90(KM.kbit_mma_kernel, signature, consts, num_warps=4,
                              launch_pdl=True)  # fmt: skip
    assert kernel.metadata.shared == table + 4 * 64 * 4 * bits * 4 + 8 + 1024 * scales
    ptx = kernel.asm["ptx"]
    first = ptx.index("cp.async.bulk.tensor.2d")
    # 4 boxes (8 at K = 3, 5; one more for the scales) at each of: the first copies, the
    # loop's refill, the last chunk's (predicated off)
    assert ptx.count("cp.async.bulk.tensor.2d") == 3 * (4 * (1 + bits % 2) + scales)
    loop = ptx[ptx.index("mbarrier.try_wait") :]
    # from the first wait on: x's loads (a 16-byte bundle a block, 4 words in this compile
    # without the JIT's divisibility) and, unless staged, the scales' (8 a quad)
    assert len(re.findall(r"\bld\.global\.b32 ", loop)) == 16 + (0 if scales else 8)
    assert re.search(rf"add\.s32\s+%r\d+, %r\d+, {table};", ptx[:first])  # slot after the table
    assert "mbarrier.try_wait" in ptx and not re.search(r"ld\.global[.\w]*\.v4", ptx)
    assert (first < ptx.index("griddepcontrol.wait")) != grouped


def test_sass_loop_probe_runs_without_a_gpu():
    """`benchmarks/sass_mma_loop.py` (the main loop's instructions per weight and the issue
    share a one-token GEMM needs at its floor, kbit-lab-log §25) still finds the loop of every
    default variant (one chunk of 32 `HMMA` a warp, 64 in the 16-token tile); K = 2 needs a
    larger share than K = 4 (half the bytes a weight, nearly as many instructions), K = 3 too,
    and the 16-token tile more than the 8-token one (its fold twice over), staged under its
    register cap at 168 registers. The integer-pipe and shared-wavefront shares come with it:
    K = 3's decode is integer-bound, and K = 2's table reads take twice K = 4's wavefronts a
    byte of weights."""
    pytest.importorskip("triton")
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "sass_mma_loop.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    shares = dict(
        re.findall(r"^(.+?)\s+\d+ regs.*issue share at the floor ([\d.]+)", done.stdout, re.M)
    )
    assert len(shares) == 13, done.stdout
    assert re.search(r"^kbit K=4 16-token staged\s+168 regs", done.stdout, re.M), done.stdout
    share = {name: float(v) for name, v in shares.items()}
    assert 0.3 < share["kbit K=4 split K"] < share["kbit K=2 split K"]
    assert share["kbit K=3 split K"] > share["kbit K=4 split K"] and share["kbit K=5 split K"] > 0.5
    assert share["kbit K=4 16-token split K"] > share["kbit K=4 split K"]
    pipes = {
        name: (float(i), float(w))
        for name, i, w in re.findall(
            r"^(.+?)\s+\d+ regs.*integer pipe ([\d.]+) \(\d+\), shared wavefronts ([\d.]+)",
            done.stdout,
            re.M,
        )
    }
    assert len(pipes) == 13, done.stdout
    assert pipes["kbit K=3 split K"][0] > 1.5 * pipes["kbit K=3 split K"][1]
    assert pipes["kbit K=2 split K"][1] > 1.5 * pipes["kbit K=4 split K"][1] > 0


def test_bench_summary_counts_rows_off_the_dequantize_path():
    """`benchmarks/bench_kbit.py`'s summary: a row whose chosen config is dequantize + cuBLAS
    times that path twice, so it is not counted as slower than it; a slower row is named. (In a
    subprocess: the script imports the Triton kernels, which other tests check stay unloaded.)"""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_kbit.py")
    code = f"""
import runpy
bench = runpy.run_path({script!r}, run_name="bench_kbit")
def row(m, config, over_deq):
    return {{"shape": "s", "K": 4096, "N": 4096, "M": m, "bits": 4, "kbit_over_floor": 2.0,
            "kbit_over_fp16": 0.5, "fp16_over_kbit": 2.0, "kbit_over_deq": over_deq,
            "config": config, "default_config": config, "kbit_us": 10.0 + m,
            "kbit_default_us": 10.0 + m, "w4a16_us": None}}
rows = [row(1, ["mma", 4], 0.2), row(256, ["deq", 128], 1.001), row(64, ["wgmma", 64], 1.1)]
print([x for x in bench["summarize"](rows) if x.startswith("rows slower")][0])
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == (
        "rows slower than dequantize + cuBLAS: 1 of the 2 not on it; s K=4 M=64"
    )


def test_tma_staging_rule(monkeypatch):
    """`mma.tma_staging`: sm_90+, 8-token tiles, one-quad chunks, all warps on one column
    block; K = 5, and K = 2, 4 with a table larger than the slot (K = 4: 32 copies; K = 2: 8
    or more); not K = 3 (measured slower)."""
    pytest.importorskip("triton")
    from quantfw.kernels.kbit.triton import mma as KM

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(KM, "cuda_capability", lambda device: (9, 0))
    assert KM.tma_staging(cuda, 4, 8, 4, 4, 4, 32)
    assert KM.tma_staging(cuda, 2, 8, 4, 4, 4, 16) and KM.tma_staging(cuda, 2, 8, 4, 4, 4, 8)
    assert KM.tma_staging(cuda, 5, 8, 4, 4, 4, 8)
    for args in [(3, 8, 4, 4, 4, 32), (5, 8, 4, 2, 4, 8), (4, 16, 4, 4, 4, 32),
                 (4, 8, 4, 1, 4, 32), (4, 8, 4, 4, 8, 32), (4, 8, 4, 4, 4, 16),
                 (2, 16, 4, 4, 4, 16), (2, 8, 4, 4, 4, 4)]:  # fmt: skip
        assert not KM.tma_staging(cuda, *args), args
    assert not KM.tma_staging(torch.device("cpu"), 4, 8, 4, 4, 4, 32)
    monkeypatch.setattr(KM, "cuda_capability", lambda device: (8, 9))
    assert not KM.tma_staging(cuda, 4, 8, 4, 4, 4, 32)


def test_scale_staging_rule():
    """`mma.scales_by_tma`: a staged launch's scale words come by TMA where a box row (``wk``
    words) is 16 bytes or more and rows are whole 16-byte units (K padded to a multiple of
    512, as Qwen3-8B's are); a launch that asks for it elsewhere is refused."""
    pytest.importorskip("triton")
    from quantfw.kernels.kbit.triton import mma as KM

    for kbs, wk, ok in ((32, 4, True), (24, 4, True), (96, 8, True), (34, 4, False),
                        (2, 4, False), (32, 2, False)):  # fmt: skip
        assert KM.scales_by_tma(torch.zeros(64, kbs, dtype=torch.int32), wk) == ok, (kbs, wk)
    assert not KM.scales_by_tma(torch.zeros(64, 40, dtype=torch.int32)[:, :32], 4)
    w = kbit.repack_weight(*random_weight(128, 4160, 4, seed=0)[:3])  # 34 scale words a row
    x = torch.randn(1, 4160, dtype=torch.float16)
    lut = torch.zeros(256, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"scale words \(128, 34\).*cannot be staged"):
        KM.kbit_mma_matmul(x, w.qweight, w.scales, lut, 128, 4, stage_by_tma=True,
                           stage_scales=True)  # fmt: skip


@pytest.mark.parametrize("blocks,kbp,tiles,warps,wk,chunk", [(384, 128, 1, 4, 4, 4),
                                                           (64, 384, 1, 4, 4, 4),
                                                           (96, 128, 2, 4, 2, 8),
                                                           (45, 92, 4, 4, 1, 4),
                                                           (7, 36, 1, 2, 2, 4)])  # fmt: skip
def test_mma_plan_covers_every_chunk_once(blocks, kbp, tiles, warps, wk, chunk):
    """`mma.plan`: warp ``ks`` of CTA ``sp`` at iteration ``it`` takes chunk ``(it * split +
    sp) * wk + ks`` (as the kernel's ``b0`` and ``b_next``): every chunk of K once, the rest
    past K (masked), and the grid within the CTAs the split was planned for."""
    pytest.importorskip("triton")
    from quantfw.kernels.kbit.triton import mma as KM

    sms, ctas_per_sm = 132, 3
    wb, split, n_iter = KM.plan(blocks, kbp, tiles, sms, warps, wk, chunk, ctas_per_sm)
    assert wb == warps // wk
    chunks = [
        (it * split + sp) * wk + ks
        for it in range(n_iter)
        for sp in range(split)
        for ks in range(wk)
    ]
    real = -(-kbp // chunk)
    assert sorted(c for c in chunks if c < real) == list(range(real))
    assert len(chunks) - real < (n_iter + 1) * wk  # split = ceil(rounds / n_iter): a short tail
    grid = -(-blocks // wb) * tiles * split
    assert grid <= max(sms * ctas_per_sm, -(-blocks // wb) * tiles)
    with pytest.raises(ValueError, match="wk=3 must divide warps=4"):
        KM.plan(blocks, kbp, tiles, sms, 4, 3, chunk, ctas_per_sm)


@pytest.mark.parametrize(
    "bits, paired", [(2, False), (2, True), (3, False), (4, False), (5, False)]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_lookup_math_on_cpu(bits, paired, dtype):
    """The mma kernel's decode on the CPU through the PTX it runs (`ptx_exec`): lane 4g + c of
    columns g and g + 8 takes its word of 4 blocks at the kernel's address (K = 4, 5: field
    word c; K = 2, 3: word c // 2, K = 3's shifted right by 16 (c % 2); K = 3, 5 also the
    1-bit word shifted by 8 c), and each step's `_lookup_asm` reads the table laid out in
    shared memory as the kernel fills it (copy lane % copies); register p = 2 h + e holds
    elements 8c + 4v + 2e, + 1 of column g + 8h, and the E4M4 byte shifted left by 6 is the
    fp16 absmax / 16. The weight rebuilt from the A registers is the reference's (levels
    rounded to `dtype` once). ``paired``: K = 2's words through `pair_columns`' PTX first, as
    16-token tiles take them."""
    import ptx_exec

    from quantfw.kernels.kbit.triton.mma import PAIR_COLUMNS_ASM, _lookup_asm, lookup_table

    N, K = 24, 256
    planes, absmax, cb, ref = random_weight(N, K, bits, seed=bits + 11)
    w = layout.repack(planes, absmax, cb)
    copies = C.default_config(1, N, K, bits)[4]
    lut = lookup_table(w.codebook, bits, dtype)  # [entries, words]
    ew = lut.shape[1]
    # word (entry * copies + copy) * ew + i holds lut[entry, i]
    shared = (lut.to(torch.int64) & 0xFFFFFFFF)[:, None].expand(-1, copies, -1).reshape(-1)
    kbp = w.padded_blocks
    q = w.qweight.to(torch.int64) & 0xFFFFFFFF
    n_pad = q.shape[0]
    blocks = torch.arange(kbp)
    cols_g = torch.arange(n_pad).view(-1, 16)[:, :8].reshape(-1)  # g of every 16 columns
    rebuilt = torch.empty(n_pad, kbp, 32)

    def quad_word(word):  # the lane's 16-byte load for blocks 4q .. 4q + 3: word `word`
        return q[:, (blocks // 4) * 4 * bits + 4 * word + blocks % 4]

    def full(v):
        return torch.full((len(cols_g), kbp), v, dtype=torch.int64)

    for c in range(4):  # lane c supplies elements 8c .. 8c + 7 of every block
        words = quad_word(c if bits >= 4 else c // 2)
        if bits == 3:
            words = words >> (16 * (c % 2))
        w0, w1 = words[cols_g], words[cols_g + 8]
        if paired:
            w0, w1 = ptx_exec.run(PAIR_COLUMNS_ASM.value, {2: w0, 3: w1}, 2)
        lane = 4 * (cols_g % 16) + c
        base = ((lane % copies) * 4 * ew)[:, None].expand(-1, kbp)
        ops = {
            4: w0,
            8: w1,
            20: base,
            24: full(0x4440 + 2 * (c % 2)),
            25: full(0x4441 + 2 * (c % 2)),
        }
        if bits % 2:
            ones = quad_word(bits - 1) >> (8 * c)
            ops.update({12: ones[cols_g], 16: ones[cols_g + 8]})
        for v in range(2):
            regs = ptx_exec.run(_lookup_asm(bits, 0, v, copies, paired), ops, 4, shared)
            for p, reg in enumerate(regs):
                half = torch.stack([reg & 0xFFFF, reg >> 16], -1)
                vals = half.to(torch.int16).view(dtype).float()  # 16 * level
                first = 8 * c + 4 * v + 2 * (p % 2)
                rebuilt[cols_g + 8 * (p // 2), :, first : first + 2] = vals
    rebuilt = rebuilt[:N]
    scale16 = (w.scales.to(torch.int32) << 6).to(torch.int16).view(torch.float16).float()
    rebuilt = (rebuilt * scale16[:N, :, None]).reshape(N, -1)[:, :K]
    levels = cb.to(dtype).float()[None, :]
    want = kfmt.dequantize(planes, absmax, levels[0]).reshape(N, K)
    assert torch.equal(rebuilt, want)
    assert ((rebuilt - ref).norm() / ref.norm()).item() < (
        4e-3 if dtype == torch.bfloat16 else 5e-4
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_lookup_math_for_mxfp4_on_cpu(dtype):
    """The same decode for MXFP4 in its runtime layout (`mxfp4.layout.pack`): lane c's word of
    4 blocks, each byte through the E2M1 table (factor 1), times the UE8M0 byte shifted left by
    23 (at least 0x00400000, the subnormal 2**-127), rebuilds `mxfp4.dequantize` bit for bit,
    every byte value under scales 0, 1, 127 and 254 included."""
    from quantfw.kernels import mxfp4
    from quantfw.kernels.kbit.triton.mma import lookup_table
    from quantfw.kernels.mxfp4 import layout as mx_layout

    g = torch.Generator().manual_seed(5)
    n, k = 70, 8224  # N and K padded (257 blocks); 8192 inputs span every byte value
    blocks, scales = mxfp4.quantize(torch.randn(n, k, generator=g))
    blocks[0, :256].view(-1)[:4096] = torch.arange(256, dtype=torch.uint8).repeat(16)
    scales[0, :4] = torch.tensor([0, 1, 127, 254], dtype=torch.uint8)
    qweight, s = mx_layout.pack(blocks, scales)
    lut = lookup_table(torch.tensor(mxfp4.FP4_VALUES), 4, dtype, factor=1.0)
    q = qweight.to(torch.int64) & 0xFFFFFFFF
    kbp = s.shape[1]
    b = torch.arange(kbp)
    rebuilt = torch.empty(q.shape[0], kbp, 32)
    for c in range(4):
        src = q[:, (b // 4) * 16 + 4 * c + b % 4]
        for byte in range(4):
            entry = lut[(src >> (8 * byte)) & 0xFF, 0]
            half = torch.stack([entry & 0xFFFF, (entry >> 16) & 0xFFFF], -1)
            rebuilt[:, :, 8 * c + 2 * byte : 8 * c + 2 * byte + 2] = (
                half.to(torch.int16).view(dtype).float()
            )
    bits_ = (s.to(torch.int32) << 23).clamp(min=0x00400000)
    scale = bits_.view(torch.float32)
    rebuilt = (rebuilt * scale[:, :, None]).reshape(q.shape[0], -1)[:n, :k]
    want = mxfp4.dequantize(blocks, scales, torch.float32)
    assert torch.equal(rebuilt, want)


# ---------------------------------------------------------------------------------------------
# GPU

gpu = pytest.mark.gpu
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(out, want):
    return ((out.double() - want).norm() / want.norm()).item()


@gpu
@pytest.mark.parametrize("bits", kfmt.SUPPORTED_BITS)
def test_gpu_repack_matches_reference(bits):
    planes, absmax, cb, _ = random_weight(392, 4160, bits, seed=bits, device="cuda")
    got = kbit.repack_weight(planes, absmax, cb)
    want = layout.repack(planes, absmax, cb)
    assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)


def _with_both_swaps(configs) -> set[tuple]:
    """`configs` plus each fused config with the other MMA orientation."""
    out = set(configs)
    out |= {(*c[:7], not c[7]) for c in configs if c[0] == "fused"}
    return out


@gpu
@pytest.mark.parametrize(
    "bits,N,K,dtype",
    [
        (2, 392, 4160, torch.float16),
        (3, 1024, 512, torch.float16),
        (4, 256, 1056, torch.float16),
        (4, 256, 1056, torch.bfloat16),
        (5, 640, 320, torch.float16),
    ],
)
def test_gpu_configs_match_reference(bits, N, K, dtype):
    """Per M in 1, 7, 16, 33, 300: the default config and the first tuning candidates, each
    fused one with SWAP off and on (split-K 1 and > 1 by shape), and deq; padded N and K,
    bias; every output element written (NaN-filled first); the workspace left clean."""
    from quantfw.kernels.common import splitk
    from quantfw.kernels.kbit.triton.dispatch import kbit_matmul_cuda

    planes, absmax, cb, ref = random_weight(N, K, bits, seed=N + K, device="cuda")
    w = kbit.repack_weight(planes, absmax, cb)
    gen = torch.Generator(device="cuda").manual_seed(bits)
    for M in (1, 7, 16, 33, 300):
        x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
        bias = torch.randn(N, device="cuda", generator=gen).to(dtype)
        want = x.double() @ ref.double().t() + bias.double()
        cands = C.candidate_configs(M, bits)
        fused = [c for c in cands if c[0] != "mma"]
        configs = _with_both_swaps({C.default_config(M, N, K, bits), *fused[:3]})
        # every mma candidate (tables, chunks, prefetch), M = 7, 16 both token tiles of 8
        configs |= {c for c in cands if c[0] == "mma"}
        assert {c[7] for c in configs if c[0] == "fused"} == {True, False}
        for cfg in sorted(configs, key=repr):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            out.copy_(kbit_matmul_cuda(x, w, bias, config=cfg))
            err = _rel(out, want)
            assert err < TOL[dtype], f"bits={bits} N={N} K={K} M={M} {dtype} {cfg}: {err:.2e}"
            worst = ((out.double() - want).abs().max() / want.abs().max()).item()
            assert worst < 4 * TOL[dtype], f"bits={bits} M={M} {cfg}: max error {worst:.2e}"
            ws, cnt = splitk.WORKSPACE.get(torch.cuda.current_device(), (None, None))
            assert ws is None or (not ws.any() and not cnt.any()), f"dirty workspace after {cfg}"
        out = kbit.kbit_matmul(x, w)  # the default config, no bias
        assert _rel(out, x.double() @ ref.double().t()) < TOL[dtype]


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_tma_staging_matches_register_loads(dtype, bits):
    """The TMA-staged weight words (sm_90) give the register-loaded kernel's sums: bit for
    bit where no split across CTAs reorders them (each column block's K in one CTA), else
    within tolerance of the float64 reference; M = 1, 5, 8, bias, N past the last block, and at
    K = 2, 4 12 and 16 tokens, the 16-token tile staged and capped at 168 registers where
    `staged_tile16` picks it (N = 24576: 384 column blocks; N = 6144: 96, split 4 ways across
    CTAs) against it unstaged and uncapped. With K padded to a multiple of 512 (K = 512, 4096,
    4608) the scale words are staged too, by default, and the same with them staged or loaded
    (K = 4160: loaded)."""
    from quantfw.kernels.common import splitk
    from quantfw.kernels.kbit.triton import dispatch
    from quantfw.kernels.kbit.triton import mma as KM

    copies = {2: 16, 3: 32, 4: 32, 5: 8}[bits]  # the defaults
    if not KM.tma_staging(torch.device("cuda"), 4, 8, 4, 4, 4, 32):
        pytest.skip("TMA staging needs sm_90+")
    gen = torch.Generator(device="cuda").manual_seed(7)
    # 384 column blocks: no split; 16: split; 96 (Qwen3-8B's qkv): the staged 16-token tile
    # split 4 ways across CTAs
    for N, K in ((24576, 512), (1000, 4160), (1000, 4608), (6144, 4096)):
        if N == 6144 and bits not in (2, 4):
            continue
        planes, absmax, cb, ref = random_weight(N, K, bits, seed=N + K, device="cuda")
        w = kbit.repack_weight(planes, absmax, cb)
        lut = dispatch._lookup_table(w, dtype)
        staged = KM.scales_by_tma(w.scales.view(torch.int32), 4)
        assert staged == (K % 512 == 0)
        for M in (1, 5, 8) + ((12, 16) if bits in (2, 4) else ()):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            bias = torch.randn(N, device="cuda", generator=gen).to(dtype)
            opts = dict(ctas_per_sm=3, copies=copies)
            modes = [dict(stage_by_tma=False), dict(stage_by_tma=True)]
            if staged:
                modes.append(dict(stage_by_tma=True, stage_scales=False))
            runs = [
                KM.kbit_mma_matmul(x, w.qweight, w.scales, lut, N, bits, bias, **opts, **mode)
                for mode in modes
            ]
            want = x.double() @ ref.double().t() + bias.double()
            what = f"bits={bits} N={N} K={K} M={M} {dtype}"
            for run in runs[1:]:
                assert torch.isfinite(run).all(), what
                assert _rel(run, want) < TOL[dtype], what
            if N == 24576:
                assert all(torch.equal(runs[0], run) for run in runs[1:]), what
            if M > 8 and N in (24576, 6144) and splitk.num_sms(x.device) == 132:
                # the staged 16-token tile ran (H100 and H200 SXM)
                assert KM.staged_tile16(M, N // 64, K // 32, 132, True, 4, 4, 4), what


@gpu
@pytest.mark.parametrize(
    "bits,inter,K,fused_at_decode",
    [(4, 12288, 4096, True), (2, 640, 512, True), (3, 640, 512, True), (5, 12288, 4096, True),
     (4, 3072, 4096, False)],
)  # fmt: skip
def test_gpu_gated_epilogue_matches_the_separate_activation(
    bits, inter, K, fused_at_decode, monkeypatch
):
    """A gated pair's rows interleaved in groups of 32 (`fused.interleave_gate_up`): with
    ``act`` the mma kernel activates each block's gate and up halves in its epilogue where the
    CTA holds the whole K (Qwen3-8B's gate_up; a small K), and the separate kernel runs after
    it where K is split across CTAs (``fused_at_decode`` False) and past the mma sizes (M =
    33, 300); K = 5's Qwen3-8B gate_up is more than one wave of CTAs (the late PDL release).
    Against the float64 GEMM then the activation, and against the unfused kernel then the
    separate activation (the same sums and roundings)."""
    from quantfw.kernels import fused as F
    from quantfw.kernels.kbit.triton import dispatch

    calls = []
    separate = F.silu_and_mul
    monkeypatch.setattr(F, "silu_and_mul", lambda *a: calls.append(1) or separate(*a))
    N = 2 * inter
    planes, absmax, cb, ref = random_weight(N, K, bits, seed=inter + bits, device="cuda")
    il = functools.partial(F.interleave_gate_up, group=kbit.GATED_GROUP)
    w = kbit.repack_weight(il(planes), il(absmax), cb)
    gen = torch.Generator(device="cuda").manual_seed(bits)
    for dtype, M, act in itertools.product(
        (torch.float16, torch.bfloat16), (1, 5, 16, 33, 300),
        (F.GatedAct("silu"), F.GatedAct("swiglu_oai", 1.702, 7.0)),
    ):  # fmt: skip
        x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
        bias = torch.randn(N, device="cuda", generator=gen).to(dtype)
        want = act((x.double() @ ref.double().t() + bias.double()).float())
        calls.clear()
        got = kbit.kbit_matmul(x, w, il(bias), act=(act, kbit.GATED_GROUP))
        assert got.shape == (M, inter) and bool(torch.isfinite(got).all())
        err = _rel(got, want.double())
        assert err < 2 * TOL[dtype], f"bits={bits} N={N} K={K} M={M} {dtype} {act}: {err:.2e}"
        cfg = dispatch._CONFIG_CACHE[dispatch._key(x, w)]
        if act.kind == "silu":  # whether the separate kernel ran
            assert (not calls) == (fused_at_decode and cfg[0] == "mma"), (M, cfg, len(calls))
        if cfg[0] == "mma":  # the same GEMM unfused, then the separate kernel
            plain = dispatch.gemm(x, w, il(bias), cfg)
            two = act(plain, kbit.GATED_GROUP)
            worst = (got.float() - two.float()).abs().max().item()
            limit = 2 * torch.finfo(dtype).eps * two.float().abs().max().item()
            assert worst <= limit, f"bits={bits} M={M} {dtype} {act}: fused and separate differ"


@gpu
@pytest.mark.parametrize("bits", kfmt.SUPPORTED_BITS)
def test_gpu_dequantize_is_exact(bits):
    from quantfw.kernels.kbit.triton.dispatch import dequantize

    planes, absmax, cb, ref = random_weight(392, 4160, bits, seed=7 + bits, device="cuda")
    w = kbit.repack_weight(planes, absmax, cb)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(dequantize(w, dtype), ref.to(dtype)), dtype


@gpu
def test_gpu_cuda_graph_capture_and_replay():
    planes, absmax, cb, ref = random_weight(1024, 2048, 4, seed=3, device="cuda")
    w = kbit.repack_weight(planes, absmax, cb)
    for M in (1, 16, 33, 128, 1024):
        x = torch.randn(M, 2048, device="cuda", dtype=torch.float16)
        kbit.kbit_matmul(x, w)  # warm-up: compile, size the workspace
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kbit.kbit_matmul(x, w)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert _rel(out, x.double() @ ref.double().t()) < TOL[torch.float16], M


@gpu
def test_gpu_tuned_table_serves_untuned_calls(tmp_path, monkeypatch):
    from quantfw.kernels.kbit.triton import dispatch, tuning

    N, K, bits = 384, 512, 3
    table = tuning.tune_shapes([(N, K, bits)], [1, 64], log=lambda s: None)
    assert set(table[(N, K, bits)]) == {1, 64}
    name = torch.cuda.get_device_name()
    T.TABLES.write_table(tmp_path / T.TABLES.file_name(name), name, table, "test")
    monkeypatch.setenv(T.ENV_DIR, str(tmp_path))
    T.TABLES.cache_clear()
    dispatch._CONFIG_CACHE.clear()
    planes, absmax, cb, ref = random_weight(N, K, bits, seed=9, device="cuda")
    w = kbit.repack_weight(planes, absmax, cb)
    for M, tuned_m in ((1, 1), (3, 64), (64, 64)):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        out = kbit.kbit_matmul(x, w)
        assert dispatch._CONFIG_CACHE[dispatch._key(x, w)] == table[(N, K, bits)][tuned_m]
        assert _rel(out, x.double() @ ref.double().t()) < 2e-3
    dispatch._CONFIG_CACHE.clear()
    T.TABLES.cache_clear()
