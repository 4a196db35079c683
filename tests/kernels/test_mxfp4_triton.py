"""The MXFP4 / grouped expert GEMM Triton kernels: under Triton's interpreter on the CPU (small
sizes; the same kernel code the GPU runs) and, marked gpu, on CUDA at GPT-OSS shapes against
the dequantize-per-expert reference, including CUDA-graph capture of a whole MoE layer."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from quantfw.kernels import moe, mxfp4
from quantfw.kernels.fused import reference as fused_ref

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "mxfp4_interpret_check.py")
SUPPORT = os.path.join(os.path.dirname(__file__), "..", "support")


def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": SUPPORT, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, SCRIPT], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAIL" not in proc.stdout and proc.stdout.count("ok ") >= 9


def test_bf16_word_decode_matches_the_reference_for_every_code_and_scale():
    """The bf16 dequantize PTX (`e2m1_word_bf16_asm`, as the kernels embed it) run on the CPU
    (`ptx_exec`): every code in every position of a word, under every UE8M0 byte (inf at s =
    255, subnormals at s <= 1), bit for bit against `mxfp4.dequantize`."""
    import ptx_exec

    from quantfw.kernels.mxfp4.triton.dequantize import e2m1_word_bf16_asm

    s = torch.arange(256).repeat_interleave(16)
    codes = torch.stack([(torch.arange(16).repeat(256) + 3 * i) % 16 for i in range(8)], -1)
    words = sum(codes[:, i] << (4 * i) for i in range(8))
    blocks = torch.zeros(len(s), 1, 16, dtype=torch.uint8)
    blocks[:, 0, :4] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    ref = mxfp4.dequantize(blocks, s.to(torch.uint8)[:, None], torch.bfloat16)[:, :8]
    assert torch.isinf(ref).any() and (ref == 0).any()
    pairs = ptx_exec.run(e2m1_word_bf16_asm(4, 5), {4: words, 5: s}, 4)
    got = torch.stack([(p >> (16 * h)) & 0xFFFF for p in pairs for h in (0, 1)], -1)
    assert torch.equal(got.to(torch.int16), ref.view(torch.int16))


def test_wgmma_fragment_order_is_the_activations_input_order():
    """The Hopper wgmma kernel's A operand, emulated lane by lane on the CPU: lane c of row n
    decodes word ``16 q + 4 c + r`` of the runtime layout (word c of block 4 q + r) and puts its
    value ``e = 4 s + 2 h + b`` at k ``128 q + 32 r + 16 s + 8 h + 2 c + b``; that A is the
    dequantized weight in `input_order`, so the kernel's sums are those of ``x @ W.T``."""
    pytest.importorskip("triton")
    from quantfw.kernels.mxfp4 import layout
    from quantfw.kernels.mxfp4.triton.wgmma import input_order

    g = torch.Generator().manual_seed(5)
    n, k = 64, 352  # 11 blocks: the last quad is padded
    blocks, scales = mxfp4.quantize(torch.randn(n, k, generator=g) * 0.05)
    qweight, s = layout.pack(blocks, scales)
    deq = mxfp4.dequantize(blocks, scales, torch.float64)
    values = torch.tensor(mxfp4.FP4_VALUES, dtype=torch.float64)
    a = torch.full((n, qweight.shape[1] * 8), float("nan"), dtype=torch.float64)
    for q, c, r, e in itertools.product(
        range(qweight.shape[1] // 16), range(4), range(4), range(8)
    ):
        word = qweight[:, 16 * q + 4 * c + r].long() & 0xFFFFFFFF
        scale = torch.ldexp(torch.ones(n, dtype=torch.float64), s[:, 4 * q + r].double() - 127)
        sh, hh, b = e // 4, (e // 2) % 2, e % 2
        a[:, 128 * q + 32 * r + 16 * sh + 8 * hh + 2 * c + b] = values[(word >> 4 * e) & 15] * scale
    assert torch.equal(a[:, :k], input_order(deq)) and not a[:, k:].any()
    x = torch.randn(7, k, generator=g, dtype=torch.float64)
    assert torch.allclose(input_order(x) @ a[:, :k].T, x @ deq.T, rtol=1e-12, atol=1e-12)
    rows = torch.tensor([6, 0, 0, 3])
    assert torch.equal(input_order(x, rows), input_order(x)[rows])


def test_gated_activation_writes_the_wgmma_input_order():
    """W2's activations come out of the gated activation already in the wgmma kernel's k
    order (``pairs_transposed``); a width that is not whole blocks of 32 is refused."""
    pytest.importorskip("triton")
    from quantfw.kernels import fused
    from quantfw.kernels.mxfp4.triton.wgmma import input_order

    y = torch.randn(5, 192, generator=torch.Generator().manual_seed(2))
    for act in (fused.GatedAct("swiglu_oai", 1.702, 7.0), fused.GatedAct("silu")):
        assert torch.equal(act(y, pairs_transposed=True), input_order(act(y)))
        assert torch.equal(act(y, 16, pairs_transposed=True), input_order(act(y, 16)))
    with pytest.raises(ValueError, match="multiple of 32"):
        fused.GatedAct("silu")(torch.randn(5, 80), pairs_transposed=True)


def test_wgmma_kernel_compiles_for_sm90_without_a_gpu():
    """The Gluon wgmma kernel through Triton's bundled ptxas for each tile height: two
    asynchronous wgmma groups (K = 64 each) per stage and 64-token chunk, the previous stage
    retired before the next is started and its slot refilled, and the decoded A never staged
    through shared memory (every shared store is the epilogue's, after the last wgmma; no
    shuffles)."""
    pytest.importorskip("triton")
    from wgmma_aot import compile_wgmma, stages_compiled

    from quantfw.kernels.mxfp4.triton import wgmma

    for bt, chunk, stages, odd in ((64, 64, 4, False), (128, 64, 3, True), (256, 64, 3, True)):
        kernel = compile_wgmma(
            wgmma.E2M1_DECODE, torch.bfloat16, bt=bt, chunk=chunk, stages=stages, odd=odd
        )
        assert kernel.metadata.shared <= 227 * 1024
        ptx = kernel.asm["ptx"]
        copies, chunks = stages_compiled(odd), bt // chunk
        assert ptx.count("wgmma.mma_async") == 8 * chunks * copies
        assert ptx.count("wgmma.commit_group") == 2 * chunks * copies
        assert ptx.count("wgmma.wait_group.sync.aligned 0;") == copies + 1
        assert "shfl" not in ptx
        assert ptx.rindex("wgmma.mma_async") < ptx.index("st.shared")


@pytest.mark.parametrize("odd", [False, True])
@pytest.mark.parametrize("decode", ["e2m1", "kbit2", "kbit3", "kbit4", "kbit5"])
def test_wgmma_kernel_keeps_its_wgmmas_asynchronous(decode, odd):
    """ptxas keeps the kernel's wgmmas asynchronous: the SASS waits for wgmma groups exactly
    where the kernel does (one a stage, one at the end), for every word decode at an even and
    an odd n_iter. With every pair of stages in the loop, an even n_iter made ptxas serialize
    them (its C7515: a wait after each wgmma, so no stage's decode overlapped the previous
    stage's products; benchmarks/kbit-lab-log.md §37), and so did an odd one at K = 2, 3, 5
    until their first stage was peeled (§38)."""
    pytest.importorskip("triton")
    from aot import sass
    from wgmma_aot import compile_wgmma, stages_compiled

    from quantfw.kernels.kbit import format as kfmt
    from quantfw.kernels.kbit.triton import wgmma as kbit_wgmma
    from quantfw.kernels.mxfp4.triton import wgmma

    if decode == "e2m1":
        asm, dtype, wpq = wgmma.E2M1_DECODE, torch.bfloat16, 16
    else:
        bits, dtype = int(decode[4:]), torch.float16
        table = kbit_wgmma.table_words(kfmt.normal_float_codebook(bits), dtype)
        asm, wpq = kbit_wgmma.codebook_word_asm(table, dtype), 4 * bits
    kernel = compile_wgmma(
        asm, dtype, bt=64, chunk=64, stages=4, wpq=wpq, odd=odd, dense=decode != "e2m1"
    )
    code = sass(kernel)
    waits = code.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert code.count("HGMMA") == 8 * stages_compiled(odd, wpq)
    assert waits == stages_compiled(odd, wpq) + 1, f"{waits} waits for wgmma groups"


def test_only_odd_counts_at_k_2_3_5_peel_their_first_stage():
    """Which launches run their first stage before the loop: odd stage counts past one with 8,
    12 or 20 words a row and quad (kbit K = 2, 3, 5); never K = 4, MXFP4 (16) or even counts."""
    from quantfw.kernels.mxfp4.triton.wgmma import peel_first_stage

    for wpq in (8, 12, 20):
        assert [peel_first_stage(n, wpq) for n in (1, 2, 3, 6, 7)] == [
            False, False, True, False, True
        ]  # fmt: skip
    assert not any(peel_first_stage(n, 16) for n in range(1, 40))


def test_default_config_by_rows_per_expert():
    """Decode: the lookup kernel; past it on sm_90 with bf16: the wgmma kernel, its token tile
    growing with the rows per expert; elsewhere a few rows: the swapped Triton kernel; prefill:
    dequantized experts and the dense kernel, with 256-column tiles on sm_90 from 512 rows per
    expert (fp16)."""
    pytest.importorskip("triton")
    from quantfw.kernels.mxfp4.triton.grouped_gemm import default_config

    def cfg(tokens, **kw):
        return default_config(4 * tokens, 32, 5760, 2880, **kw)

    assert cfg(1)["LUT"] and cfg(16, hopper=True)["LUT"] and not cfg(1, mxfp4=False).get("LUT")
    # 9-16 rows an expert: 16-row blocks, staged under kbit's register cap on sm_90 when
    # grouped (a dense MXFP4 linear, one group, keeps the unstaged tile)
    from quantfw.kernels.kbit.triton.mma import TILE16_STAGED_MAXNREG

    assert [cfg(t)["BLOCK_M"] for t in (64, 65, 128)] == [8, 16, 16]
    assert not cfg(128).get("stage_by_tma") and not cfg(64, hopper=True).get("stage_by_tma")
    staged = cfg(128, hopper=True)
    assert staged["stage_by_tma"] and staged["maxnreg"] == TILE16_STAGED_MAXNREG
    assert not default_config(16, 1, 5760, 2880, hopper=True).get("stage_by_tma")
    small = {"BLOCK_M": 64, "WGMMA": True, "stages": 4}
    assert cfg(256, hopper=True) == cfg(512, hopper=True) == small
    for tokens, chunk in ((1024, 64), (2048, 64), (4096, 256), (8192, 256)):
        want = {"BLOCK_M": 256, "WGMMA": True, "stages": 3, "chunk": chunk}
        assert cfg(tokens, hopper=True) == want, tokens
    assert cfg(256)["SWAP"] and not cfg(256).get("DEQUANT")
    half = torch.float16
    for tokens, hopper, width in ((2048, True, 128), (4096, True, 256), (4096, False, 128)):
        c = cfg(tokens, hopper=hopper, dtype=half)
        assert c["DEQUANT"] and c["BLOCK_N"] == width, (tokens, hopper, c)
    assert not cfg(4096, mxfp4=False, hopper=True)["DEQUANT"]
    assert not cfg(4096, mxfp4=False, hopper=True).get("WGMMA")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_dequantize_kernel_is_bitwise(dtype):
    """The experts' dequantize kernel (bf16: the PTX word decode; others: per nibble) against
    `mxfp4.dequantize`, bit for bit, with every UE8M0 byte present; K = 2880 ends inside a quad,
    N = 200 inside a row tile. The output is NaN-filled first, so an unwritten element fails."""
    pytest.importorskip("triton")
    from quantfw.kernels.mxfp4 import grouped
    from quantfw.kernels.mxfp4.triton import dequantize as deq

    g = torch.Generator(device="cuda").manual_seed(13)
    blocks, scales = mxfp4.quantize(torch.randn(3, 200, 2880, generator=g, device="cuda"))
    scales.view(-1)[:256] = torch.arange(256, dtype=torch.uint8, device="cuda")
    scales.view(-1)[256:] = torch.randint(0, 256, (scales.numel() - 256,), generator=g,
                                          device="cuda", dtype=torch.int32).to(torch.uint8)  # fmt: skip
    got = torch.full(blocks.shape[:2] + (2880,), float("nan"), dtype=dtype, device="cuda")
    deq.dequantize(grouped.Mxfp4Weights.pack(blocks, scales), dtype, out=got)
    ref = mxfp4.dequantize(blocks, scales, dtype)
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    assert torch.equal(got.view(bits), ref.view(bits))


_WEIGHTS: dict = {}


def _experts(e, n, k, dtype, quantized, seed):
    """Random experts [e, n, k] on the GPU (cached per shape: GPT-OSS's are large) and their
    float32 dequantization. Quantized an expert at a time, in place: the quantizer's
    temporaries for a whole GPT-OSS-20B W13 (530 M elements, GBs each) are the likely reason
    two xdist workers held 36-38 GB each and ran the GPU out of memory
    (benchmarks/results/scales-tma/gpu-tests-oom.log); with it the same run passed on an 80 GB
    H100 (benchmarks/results/final-2026-11-27/gpu-tests.log)."""
    from quantfw.kernels.mxfp4 import grouped

    key = (e, n, k, dtype, quantized, seed)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()  # keep one layer's worth of experts alive
        torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(seed)
        w = torch.randn(e, n, k, generator=g, device="cuda") * 0.05
        if quantized:
            parts = []
            for ex in range(e):  # per block, so per expert gives the same bytes
                parts.append(mxfp4.quantize(w[ex]))
                w[ex] = mxfp4.dequantize(*parts[-1], torch.float32)
            blocks = torch.stack([b for b, _ in parts])
            scales = torch.stack([s for _, s in parts])
            pair = (grouped.Mxfp4Weights.pack(blocks, scales), w)
        else:
            pair = (grouped.DenseWeights(w.to(dtype)), w.to(dtype).float())
        _WEIGHTS[key] = pair
    return _WEIGHTS[key]


def _moe_case(tokens, e, h, i, top, dtype, quantized, seed=0):
    w13, d13 = _experts(e, 2 * i, h, dtype, quantized, seed)
    w2, d2 = _experts(e, h, i, dtype, quantized, seed + 1)
    g = torch.Generator(device="cuda").manual_seed(seed + tokens)
    b13 = (torch.randn(e, 2 * i, generator=g, device="cuda") * 0.1).to(dtype)
    b2 = (torch.randn(e, h, generator=g, device="cuda") * 0.1).to(dtype)
    x = torch.randn(tokens, h, generator=g, device="cuda").to(dtype)
    logits = torch.randn(tokens, e, generator=g, device="cuda").to(dtype)
    weights, ids = moe.select_experts(logits, top, "topk_softmax")
    act = lambda y: fused_ref.swiglu_oai(y, 1.702, 7.0)  # noqa: E731
    ref = moe.experts_forward_cpu(
        x.float(), weights.float(), ids, num_experts=e,
        expert_weights=lambda ex: (d13[ex], d2[ex]),
        activation=act, w13_bias=b13.float(), w2_bias=b2.float(),
    )  # fmt: skip
    return dict(x=x, weights=weights, ids=ids, w13=w13, w2=w2, b13=b13, b2=b2, act=act), ref


def _run(case, config=None):
    from quantfw.kernels.mxfp4 import grouped

    return grouped.moe_forward(
        case["x"], case["weights"], case["ids"], w13=case["w13"], w2=case["w2"],
        w13_bias=case["b13"], w2_bias=case["b2"], activation=case["act"], config=config,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [True, False], ids=["mxfp4", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("i", [2880, 736, 384])  # GPT-OSS-20B's I at tp 1, 4, 8
def test_gpu_moe_matches_reference(dtype, quantized, i):
    pytest.importorskip("triton")
    for tokens in (1, 3, 16, 77, 512):  # the one-launch sort up to 64 tokens, torch's beyond
        case, ref = _moe_case(tokens, 32, 2880, i, 4, dtype, quantized)
        out = _run(case)
        assert out.dtype == dtype and torch.isfinite(out).all()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err <= 2e-2, f"{tokens} tokens: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4, SWAP=True),
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2, SWAP=True),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, DEQUANT=True),
        dict(BLOCK_M=8, LUT=True, copies=32, ctas_per_sm=3, chunk=4),
        dict(BLOCK_M=8, LUT=True, copies=1, ctas_per_sm=4, chunk=8, pipe=True),
        dict(BLOCK_M=16, LUT=True, copies=16, ctas_per_sm=2, chunk=4),
        dict(
            BLOCK_M=16, LUT=True, copies=32, ctas_per_sm=3, chunk=4, stage_by_tma=True, maxnreg=168
        ),
        dict(BLOCK_M=64, WGMMA=True, stages=4),
        dict(BLOCK_M=128, WGMMA=True, stages=3),
        dict(BLOCK_M=256, WGMMA=True, stages=3),
        dict(BLOCK_M=128, WGMMA=True, stages=3, chunk=32),
        dict(BLOCK_M=256, WGMMA=True, stages=3, chunk=64),
    ],
)
def test_gpu_configs_agree(config):
    """Every kernel on one case: 200 tokens over 8 experts (many row blocks per expert), H = 288
    and I = 224 (W2's N = 288 pads to whole column blocks, both K to whole quads; the wgmma
    kernel's 128-column tiles end inside an expert's padding, W13 runs an odd quad, and with
    chunks the token rows past an expert's end are skipped: about 50 rows an expert)."""
    pytest.importorskip("triton")
    if config.get("WGMMA") or config.get("stage_by_tma"):
        from quantfw.kernels.common import is_sm90

        if not is_sm90(torch.device("cuda")):
            pytest.skip("the wgmma kernel and TMA staging need sm_90")
    case, ref = _moe_case(200, 8, 288, 224, 2, torch.bfloat16, True, seed=3)
    err = ((_run(case, config).float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_dense_linear_matches_reference(dtype):
    """A dense MXFP4 layer (a group of one) at every path's sizes, N and K padded, with bias;
    the output is NaN-filled first, so an unwritten element fails."""
    from quantfw.kernels.mxfp4 import grouped

    g = torch.Generator(device="cuda").manual_seed(11)
    n, k = 200, 352
    blocks, scales = mxfp4.quantize(torch.randn(n, k, generator=g, device="cuda") * 0.05)
    w = grouped.Mxfp4Weights.pack(blocks, scales)
    dense = mxfp4.dequantize(blocks, scales, torch.float64)
    bias = torch.randn(n, generator=g, device="cuda").to(dtype)
    for m in (1, 5, 16, 40, 300):
        x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        out.copy_(grouped.linear(x, w, bias))
        ref = x.double() @ dense.T + bias.double()
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-2, f"M={m}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top,experts,block_m", [(2048, 4, 32, 256), (3000, 8, 128, 64)])
def test_gpu_sort_and_plan_equals_the_torch_sort(tokens, top, experts, block_m):
    """Prefill-sized batches: the chunked sort and block plan give torch's stable sort and
    `block_schedule` exactly (skewed routing: half the tokens pick expert 0 first)."""
    pytest.importorskip("triton")
    from quantfw.kernels.mxfp4.triton import sort as sort_kernels

    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=g, device="cuda")
    logits[: tokens // 2, 0] += 10
    ids = logits.topk(top, dim=-1).indices
    assert not sort_kernels.align_fits(ids.numel(), experts)
    got, plan = sort_kernels.sort_and_plan(ids, experts, block_m)
    ref = moe.sort_by_expert(ids, experts)
    ref_plan = moe.block_schedule(ref.m_indptr, ids.numel(), block_m, top)
    for field in ("token_index", "expert_of_row", "inverse", "m_indptr"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field
    assert torch.equal(plan.block_expert, ref_plan.block_expert)
    real = ref_plan.block_expert < experts
    assert torch.equal(plan.block_row[real], ref_plan.block_row[real])


@pytest.mark.gpu
def test_gpu_float32_matches_the_cpu_path_closely():
    pytest.importorskip("triton")
    case, ref = _moe_case(9, 8, 128, 96, 2, torch.float32, True, seed=5)
    assert ((_run(case) - ref).abs().max() / ref.abs().max()).item() <= 1e-5


@pytest.mark.gpu
def test_gpu_moe_layer_captures_in_a_cuda_graph():
    pytest.importorskip("triton")
    case, _ = _moe_case(4, 32, 2880, 2880, 4, torch.bfloat16, True, seed=7)
    eager = _run(case)
    static_x = case["x"].clone()
    case["x"] = static_x
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _run(case)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(case)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scoring", ["topk_softmax", "softmax_topk"])
def test_gpu_router_topk_matches_torch(dtype, scoring):
    """The one-launch router (`moe.select_experts` on CUDA: `triton_routing.router_topk`)
    against torch's softmax / topk on the same GPU: the same experts in the same order, every
    weight within one unit in the last place of the output dtype (GPT-OSS and Qwen3-MoE expert
    counts, decode to prefill)."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(11)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6}[dtype]
    for t, e, k in ((1, 32, 4), (16, 32, 4), (4096, 32, 4), (7, 128, 8), (1000, 128, 8)):
        for renorm in (False, True):
            rows = torch.stack([torch.randperm(e, generator=g) for _ in range(t)])
            logits = ((rows - e / 2) / 8).to(dtype).cuda()  # distinct in every dtype: no ties
            w, ids = moe.select_experts(logits, k, scoring, renorm)
            assert w.dtype == dtype and ids.dtype == torch.int64
            if scoring == "softmax_topk":
                ref_w, ref_ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), k)
                ref_w = (ref_w / ref_w.sum(-1, keepdim=True) if renorm else ref_w).to(dtype)
            else:
                v, ref_ids = torch.topk(logits, k)
                ref_w = torch.softmax(v, -1, dtype=dtype)
                ref_w = ref_w / ref_w.sum(-1, keepdim=True) if renorm else ref_w
            assert torch.equal(ids, ref_ids), (t, e, k, renorm)
            err = ((w.double() - ref_w.double()).abs() / ref_w.double().abs()).max().item()
            assert err <= ulp, (t, e, k, renorm, err)
