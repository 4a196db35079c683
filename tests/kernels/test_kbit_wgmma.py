"""kbit weights through the Hopper wgmma kernel (`kbit.triton.wgmma`): the codebook decode's
algorithm on the CPU, an ahead-of-time sm_90 compile (no GPU), the config choice, and the
kernel against the float64 reference on a GPU (marked ``gpu``)."""

from __future__ import annotations

import re

import pytest
import torch

from quantfw.kernels import kbit
from quantfw.kernels.kbit import configs as C
from quantfw.kernels.kbit import format as kfmt

triton = pytest.importorskip("triton")

from quantfw.kernels.kbit.triton import wgmma as KW  # noqa: E402


def _codebooks(bits: int = 4):
    g = torch.Generator().manual_seed(3)
    user = torch.sort(torch.randn(2**bits, generator=g) * 3).values
    user[user.abs().argmin()] = 0.0  # a zero level (+0 times any scale), still ascending
    return [kfmt.normal_float_codebook(bits), user]


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_codebook_decode_on_cpu(bits, dtype):
    """The decode PTX (`codebook_word_asm`, as the kernel embeds it) run on the CPU
    (`ptx_exec`) gives, for random fields (K = 2, 3: 2-bit fields in the low 16 bits, the high
    ones random; K = 3, 5: the 1-bit fields in the low byte of a second word, its other bytes
    random) and every E4M4 byte (zero and subnormal scales included), ``16 * level`` in the
    dtype times ``absmax / 16``, rounded once, in the fields' order."""
    import ptx_exec

    g = torch.Generator().manual_seed(bits + int(dtype == torch.bfloat16))
    for cb in _codebooks(bits):
        idx = torch.randint(0, 2**bits, (4096, 8), generator=g)
        idx[: 2**bits] = torch.arange(2**bits)[:, None]  # every level
        width = 4 if bits >= 4 else 2  # the first field group's
        words = sum((idx[:, t] % 2**width) << (width * t) for t in range(8))
        if bits < 4:  # the other lane's half of the word
            words |= torch.randint(0, 2**16, (4096,), generator=g) << 16
        ones = None
        if bits in (3, 5):  # the 1-bit fields, the other lanes' bytes above
            ones = sum((idx[:, t] >> width) << t for t in range(8))
            ones |= torch.randint(0, 2**24, (4096,), generator=g) << 8
        scale = torch.arange(4096) % 256
        asm = KW.codebook_word_asm(KW.table_words(cb, dtype), dtype)
        operands = {KW.WORD: words, KW.SCALE: scale}
        if ones is not None:
            operands = {KW.WORD: words, KW.ONES: ones, KW.SCALE_WITH_ONES: scale}
        pairs = ptx_exec.run(asm, operands, 4)
        got = torch.stack([(p >> (16 * h)) & 0xFFFF for p in pairs for h in (0, 1)], -1)
        got = got.to(torch.int16).view(dtype)
        absmax = kfmt.decode_e4m4(scale.to(torch.uint8)).double()
        want = ((16 * cb.float()).to(dtype).double()[idx] * (absmax / 16)[:, None]).to(dtype)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        # two roundings from the exact value where the result is a normal number
        exact = cb.double()[idx] * absmax[:, None]
        normal = want.double().abs() >= torch.finfo(dtype).smallest_normal
        assert (want.double() / exact - 1)[normal].abs().max() <= 2 * torch.finfo(dtype).eps


def test_codebook_decode_rejects_what_it_cannot_decode():
    with pytest.raises(ValueError, match="a codebook of 4, 8, 16 or 32 levels"):
        KW.table_words(torch.linspace(-1, 1, 6), torch.float16)
    with pytest.raises(ValueError, match="a table of 2, 4, 8 or 16 registers"):
        KW.codebook_word_asm((0,) * 6, torch.float16)
    with pytest.raises(ValueError, match="fp16 or bf16, got torch.float32"):
        KW.codebook_word_asm((0,) * 8, torch.float32)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_wgmma_kernel_with_the_codebook_compiles_for_sm90_without_a_gpu(bits, dtype):
    """The dense launch with the codebook decode through Triton's bundled ptxas: per word of 8
    fields, K = 4: two mask, eight lookup and four pairing ``prmt`` plus the scale's and four
    ``lop3``; K = 5: four mask, sixteen lookup and four pairing ``prmt`` plus the scale's and
    twelve ``lop3``; K = 2, 3: four lookup and four pairing ``prmt`` plus the scale's; four
    packed FMAs; at K = 3, 5 a second TMA copy a stage (the 1-bit words); the levels are
    immediates (no memory read for a lookup); the decoded A never staged through shared memory
    (every shared store after the last wgmma); no spills."""
    from aot import resource_usage
    from wgmma_aot import compile_wgmma, stages_compiled

    table = KW.table_words(_codebooks(bits)[1], dtype)
    decode = KW.codebook_word_asm(table, dtype)
    kernel = compile_wgmma(
        decode, dtype, bt=128, chunk=64, stages=3, wpq=4 * bits, dense=True, split=4
    )
    ptx = kernel.asm["ptx"]
    compiled = stages_compiled(False)  # the loop's pair and the last pair
    words = compiled * 8  # 8 words a thread and stage
    assert ptx.count("prmt.b32") == words * {2: 9, 3: 9, 4: 15, 5: 25}[bits]
    assert ptx.count("lop3.b32") == words * {2: 0, 3: 0, 4: 4, 5: 12}[bits]
    # per stage (S - 1 ahead, then one a compiled stage): the words, x's two halves, at K = 3,
    # 5 the 1-bit words
    assert ptx.count("cp.async.bulk.tensor") == (3 + (bits in (3, 5))) * (3 - 1 + compiled)
    assert ptx.count(f"fma.rn.{'f16' if dtype == torch.float16 else 'bf16'}x2") == words * 4
    assert ptx.count("wgmma.mma_async") == 8 * 2 * compiled  # 8 per stage and chunk, 2 chunks
    assert "ld.local" not in ptx and "shfl" not in ptx
    assert ptx.rindex("wgmma.mma_async") < ptx.index("st.shared")
    assert all(f"{t:#x}," in ptx for t in table)
    usage = resource_usage(kernel)
    assert re.search(r"REG:\d+ STACK:0 ", usage) and "LOCAL:0 " in usage, usage


def test_launch_mode_marks_calls_for_cuda_graphs():
    from quantfw.kernels.common.launch_mode import graph_launches, graph_launches_active

    assert not graph_launches_active()
    with graph_launches():
        with graph_launches():
            assert graph_launches_active()
        assert graph_launches_active()
    assert not graph_launches_active()


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_default_configs_where_the_wgmma_kernel_may_run(bits):
    """Where it may run (sm_90, calls for CUDA graphs): the mma kernel to 16 tokens, then the
    wgmma kernel: 64-token tiles to 64, 128 to 128, then 256-token tiles for large weights (to
    256) and wide ones (to 1024, K = 5 to 256), else dequantize + cuBLAS; other GPUs keep
    their paths; the candidates add the wgmma kernel's from 16 tokens."""
    Ms = (1, 16, 17, 64, 65, 128, 129, 256, 257, 1024, 1025)
    gate_up, down, o = (24576, 4096), (4096, 12288), (4096, 4096)
    tiles = {shape: [C.default_config(M, *shape, bits, wgmma=True)[:2] for M in Ms]
             for shape in (gate_up, down, o)}  # fmt: skip
    first = [("mma", 4)] * 2 + [("wgmma", 64)] * 2 + [("wgmma", 128)] * 2
    wide = 4 if bits < 5 else 2  # K = 5: its decode costs more, gate_up to 256 tokens
    assert tiles[gate_up] == first + [("wgmma", 256)] * wide + [("deq", 128)] * (5 - wide)
    assert tiles[down] == first + [("wgmma", 256)] * 2 + [("deq", 128)] * 3
    assert tiles[o] == first + [("deq", 128)] * 5
    assert C.default_config(64, *gate_up, bits)[0] == "fused"
    for M in (16, 64, 1024):
        cands = C.candidate_configs(M, bits, wgmma=True)
        assert cands[0] == C.default_config(M, 0, 0, bits, wgmma=True) and len(set(cands)) == len(cands)  # fmt: skip
        assert sum(c[0] == "wgmma" for c in cands) == 4
        assert all(C.check_config(c) == c for c in cands)
        assert not any(c[0] == "wgmma" for c in C.candidate_configs(M, bits))
    with pytest.raises(ValueError, match="block_tokens=32, chunk=32: tiles of 64, 128 or 256"):
        C.check_config(("wgmma", 32, 3, 32))
    with pytest.raises(ValueError, match="block_tokens=256, chunk=32"):
        C.check_config(("wgmma", 256, 3, 32))
    with pytest.raises(ValueError, match="stages=7 must be 2..6"):
        C.check_config(("wgmma", 128, 7, 64))


# GPU

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _hopper():
    from quantfw.kernels.common import is_sm90

    if not torch.cuda.is_available() or not is_sm90(torch.device("cuda")):
        pytest.skip("the wgmma kernel needs an sm_90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N,K", [(200, 352), (640, 4096), (1536, 4096)])
def test_gpu_wgmma_matches_reference(bits, dtype, N, K):
    """Every wgmma candidate config and the default at M = 17, 64, 100, 300, 1030 against the
    float64 product of the dequantized weight: N past the last 128-column tile, K with a padded
    quad, split-K (few column tiles) and none, CTAs of one, two and an odd number (3, 7) of
    stages (1536 columns on 132 SMs), a user codebook, bias or none; outputs
    NaN-filled first (every element written); the split-K workspace left clean."""
    _hopper()
    from quantfw.kernels.common import splitk
    from quantfw.kernels.common.launch_mode import graph_launches
    from quantfw.kernels.kbit.triton.dispatch import kbit_matmul_cuda

    gen = torch.Generator().manual_seed(N + K + bits)
    for cb in _codebooks(bits):
        w_dense = torch.randn(N, K, generator=gen) * 0.05
        planes, absmax = kfmt.quantize(w_dense, bits, cb)
        ref = kfmt.dequantize(planes, absmax, cb).double().cuda()
        w = kbit.repack_weight(planes.cuda(), absmax.cuda(), cb.cuda())
        for M in (17, 64, 100, 300, 1030):
            x = torch.randn(M, K, generator=gen).to(dtype).cuda()
            bias = torch.randn(N, generator=gen).to(dtype).cuda() if M % 2 else None
            want = x.double() @ ref.t() + (bias.double() if bias is not None else 0)
            configs = {c for c in C.candidate_configs(M, bits, wgmma=True) if c[0] == "wgmma"}
            for cfg in sorted(configs | {None}, key=repr):
                out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
                with graph_launches():  # (None: the default of a call for CUDA graphs)
                    out.copy_(kbit_matmul_cuda(x, w, bias, config=cfg))
                err = ((out.double() - want).norm() / want.norm()).item()
                assert err < TOL[dtype], f"bits={bits} N={N} K={K} M={M} {dtype} {cfg}: {err:.2e}"
                ws, cnt = splitk.WORKSPACE.get(torch.cuda.current_device(), (None, None))
                assert ws is None or (not ws.any() and not cnt.any()), f"dirty after {cfg}"


@pytest.mark.gpu
def test_gpu_wgmma_default_inside_a_cuda_graph():
    """A call made for CUDA graphs (`graph_launches`: warm-up, then capture) takes the wgmma
    kernel at 32 tokens and replays it correctly on new inputs (the k-order copy and the
    split-K workspace inside the graph); the same call made eagerly takes another kernel."""
    _hopper()
    from quantfw.kernels.common.launch_mode import graph_launches
    from quantfw.kernels.kbit.triton import dispatch

    gen = torch.Generator().manual_seed(7)
    N, K = 640, 4096  # 5 column tiles: split along K
    planes, absmax = kfmt.quantize(torch.randn(N, K, generator=gen) * 0.05, 4)
    cb = kfmt.normal_float_codebook(4)
    ref = kfmt.dequantize(planes, absmax, cb).double().cuda()
    w = kbit.repack_weight(planes.cuda(), absmax.cuda(), cb.cuda())
    x = torch.randn(32, K, generator=gen).half().cuda()
    with graph_launches():
        dispatch.kbit_matmul_cuda(x, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dispatch.kbit_matmul_cuda(x, w)
    key = dispatch._key(x, w)[:-1]
    assert dispatch._CONFIG_CACHE[(*key, True)][0] == "wgmma"
    dispatch.kbit_matmul_cuda(x, w)
    assert dispatch._CONFIG_CACHE[(*key, False)][0] != "wgmma"
    for _ in range(3):
        x.copy_(torch.randn(32, K, generator=gen).half())
        out.fill_(float("nan"))
        graph.replay()
        want = x.double() @ ref.t()
        assert ((out.double() - want).norm() / want.norm()).item() < TOL[torch.float16]
