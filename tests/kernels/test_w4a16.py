"""W4A16 layout transforms (CPU, run in CI) and the Triton kernels (GPU, marked ``gpu``).

The reference here is deliberately independent of quantfw/kernels/w4a16/: checkpoints are
packed and dequantized element by element from the format definitions (AutoAWQ, GPTQ v1/v2)."""

from __future__ import annotations

import sys

import pytest
import torch

from quantfw.kernels import w4a16 as W

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i holds column 8c + AWQ_PACK_ORDER[i]


# --------------------------------------------------------------------------------------------
# independent checkpoint writers and dequantizers


def _to_i32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """[R, C] ints 0..15 -> AutoAWQ int32 [R, C/8]."""
    R, C = q.shape
    out = torch.zeros(R, C // 8, dtype=torch.int64)
    for c in range(C // 8):
        for i in range(8):
            out[:, c] |= q[:, 8 * c + AWQ_PACK_ORDER[i]].to(torch.int64) << (4 * i)
    return _to_i32(out)


def gptq_pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] ints -> GPTQ qweight int32 [K/8, N], nibble i of word r = row 8r + i."""
    K, N = q.shape
    out = torch.zeros(K // 8, N, dtype=torch.int64)
    for r in range(K // 8):
        for i in range(8):
            out[r] |= q[8 * r + i].to(torch.int64) << (4 * i)
    return _to_i32(out)


def gptq_pack_cols(z: torch.Tensor) -> torch.Tensor:
    """[G, N] ints -> GPTQ qzeros int32 [G, N/8], nibble i of word c = column 8c + i."""
    G, N = z.shape
    out = torch.zeros(G, N // 8, dtype=torch.int64)
    for c in range(N // 8):
        for i in range(8):
            out[:, c] |= (z[:, 8 * c + i].to(torch.int64) & 0xF) << (4 * i)
    return _to_i32(out)


def nibble(word: torch.Tensor, i: int) -> torch.Tensor:
    return (word.to(torch.int64) >> (4 * i)) & 0xF


def awq_dequant_ref(qweight, qzeros, scales, G) -> torch.Tensor:
    K, N = qweight.shape[0], qweight.shape[1] * 8
    w = torch.empty(K, N, dtype=torch.float64)
    for c in range(N // 8):
        for i in range(8):
            n = 8 * c + AWQ_PACK_ORDER[i]
            q = nibble(qweight[:, c], i)
            z = nibble(qzeros[:, c], i)
            s = scales[:, n].double()
            g = torch.arange(K) // G
            w[:, n] = (q - z[g]).double() * s[g]
    return w


def gptq_dequant_ref(qweight, qzeros, scales, g_idx, v1: bool) -> torch.Tensor:
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    q = torch.empty(K, N, dtype=torch.int64)
    for r in range(K // 8):
        for i in range(8):
            q[8 * r + i] = nibble(qweight[r], i)
    z = torch.empty(scales.shape[0], N, dtype=torch.int64)
    for c in range(N // 8):
        for i in range(8):
            z[:, 8 * c + i] = nibble(qzeros[:, c], i)
    if v1:
        z = z + 1
    g = g_idx.long()
    return (q - z[g]).double() * scales.double()[g]


def rand_scales(rows, cols, gen):
    return (torch.rand(rows, cols, generator=gen) * 0.02 + 0.002).to(torch.float16)


def make_awq(K, N, G, seed):
    gen = torch.Generator().manual_seed(seed)
    gs = K if G == -1 else G
    ng = -(-K // gs)
    q = torch.randint(0, 16, (K, N), generator=gen)
    z = torch.randint(0, 16, (ng, N), generator=gen)
    s = rand_scales(ng, N, gen)
    qweight, qzeros = awq_pack(q), awq_pack(z)
    return (qweight, qzeros, s), awq_dequant_ref(qweight, qzeros, s, gs)


def make_gptq(K, N, G, seed, *, sym, v1, act_order, zeros_none=False):
    gen = torch.Generator().manual_seed(seed)
    gs = K if G == -1 else G
    ng = -(-K // gs)
    q = torch.randint(0, 16, (K, N), generator=gen)
    if sym:
        z = torch.full((ng, N), 8)
    else:
        z = torch.randint(1 if v1 else 0, 16, (ng, N), generator=gen)
    s = rand_scales(ng, N, gen)
    g_idx = torch.arange(K) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=gen)]
    qweight = gptq_pack_rows(q)
    qzeros = gptq_pack_cols(z - 1 if v1 else z)
    ref = gptq_dequant_ref(qweight, qzeros, s, g_idx, v1)
    return (qweight, None if zeros_none else qzeros, s, g_idx.to(torch.int32)), ref


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _check_cpu(packed, ref_w, seed):
    K, N = ref_w.shape
    # the packed layout, read back by the CPU twin, undoes the act-order sort exactly
    w = W.dequantize_packed(packed).double()
    if packed.perm is not None:
        inv = torch.empty_like(packed.perm)
        inv[packed.perm] = torch.arange(K)
        w = w[inv]
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(3, 2, K, generator=gen).to(torch.float16)
    bias = torch.randn(N, generator=gen).to(torch.float16)
    out = W.w4a16_matmul(x, packed, bias)
    assert out.shape == (3, 2, N) and out.dtype == torch.float16
    ref = x.double() @ ref_w + bias.double()
    assert _rel(out, ref) < 2e-3


# --------------------------------------------------------------------------------------------
# CPU: layout transforms against the independent reference


@pytest.mark.parametrize("G,n_groups", [(32, 3), (64, 5), (128, 3), (-1, 1)])
def test_awq_repack_matches_reference(G, n_groups):
    K = 96 if G == -1 else G * n_groups
    N = 40
    (qw, qz, s), ref = make_awq(K, N, G, seed=K + N)
    packed = W.repack_awq(qw, qz, s, G)
    assert packed.perm is None and packed.qweight.shape == (-(-N // 64), -(-K // 16), 32, 4)
    _check_cpu(packed, ref, seed=1)


@pytest.mark.parametrize("G", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_repack_matches_reference(G, sym, v1, act_order):
    K = 96 if G == -1 else G * 3
    N = 24
    seed = hash((G, sym, v1, act_order)) % 1000
    (qw, qz, s, g_idx), ref = make_gptq(K, N, G, seed, sym=sym, v1=v1, act_order=act_order)
    fmt = "gptq" if v1 else "gptq_v2"
    packed = W.repack_gptq(qw, qz, s, g_idx, G, sym, fmt)
    assert (packed.perm is not None) == (act_order and G != -1)
    if packed.perm is not None:
        assert packed.group_size == G  # a real act-order schedule keeps whole groups
    _check_cpu(packed, ref, seed=seed)


def test_gptq_sym_without_qzeros():
    (qw, _, s, g_idx), ref = make_gptq(
        256, 16, 64, 7, sym=True, v1=False, act_order=True, zeros_none=True
    )
    packed = W.repack_gptq(qw, None, s, g_idx, 64, True, "gptq_v2")
    _check_cpu(packed, ref, seed=7)


def make_irregular_gptq(K, N, ng, seed):
    """GPTQ v2 with a random g_idx (uneven, shuffled groups) -> (PackedW4, reference weight)."""
    gen = torch.Generator().manual_seed(seed)
    g_idx = torch.randint(0, ng, (K,), generator=gen)
    q = torch.randint(0, 16, (K, N), generator=gen)
    z = torch.randint(0, 16, (ng, N), generator=gen)
    s = rand_scales(ng, N, gen)
    qw, qz = gptq_pack_rows(q), gptq_pack_cols(z)
    ref = gptq_dequant_ref(qw, qz, s, g_idx, v1=False)
    return W.repack_gptq(qw, qz, s, g_idx, 32, False, "gptq_v2"), ref


def test_gptq_irregular_groups():
    """g_idx with uneven, shuffled groups: rows are sorted and split into gcd-sized chunks."""
    packed, ref = make_irregular_gptq(128, 16, 5, seed=3)
    _check_cpu(packed, ref, seed=3)


def test_pack_unpack_roundtrip():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (7, 64), generator=gen)
    for order in (W.NIBBLE_OF, None):
        assert torch.equal(W.unpack_cols(W.pack_cols(q, order), order).long(), q)
    # the module's AWQ order is the inverse of AutoAWQ's pack order
    assert torch.equal(W.pack_cols(q), awq_pack(q))
    q8 = torch.randint(0, 16, (16, 24), generator=gen)
    assert torch.equal(W.unpack_rows(gptq_pack_rows(q8)).long(), q8)


def test_mma_layout_matches_its_definition():
    """Word [nb, kb, 4g + c, j], nibble 4h + 2t + e holds q[16kb + 8e + 2c + h, 64nb + 16j + 8t + g]:
    the B-fragment registers of mma.m16n8k16 (PTX ISA) for the two 8-column tiles t."""
    gen = torch.Generator().manual_seed(4)
    K, N = 48, 128
    q = torch.randint(0, 16, (K, N), generator=gen, dtype=torch.uint8)
    qf = W.pack_mma(q)
    assert qf.shape == (2, 3, 32, 4)
    assert torch.equal(W.unpack_mma(qf), q)
    words = qf.to(torch.int64) & 0xFFFFFFFF
    for nb in range(2):
        for kb in range(3):
            for lane in range(32):
                g, c = divmod(lane, 4)
                for j in range(4):
                    for s in range(8):
                        h, t, e = s // 4, (s // 2) % 2, s % 2
                        k, n = 16 * kb + 8 * e + 2 * c + h, 64 * nb + 16 * j + 8 * t + g
                        assert (int(words[nb, kb, lane, j]) >> (4 * s)) & 0xF == int(q[k, n])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_scales_roundtrip(dtype):
    gen = torch.Generator().manual_seed(5)
    s = rand_scales(3, 192, gen)
    z = torch.randint(0, 16, (3, 192), generator=gen)
    sz = W.pack_mma_scales(s, z, dtype)
    assert sz.shape == (3, 3, 8, 8)
    s2, z2 = W.unpack_mma_scales(sz, dtype)
    assert torch.equal(z2, z.to(torch.int32))
    assert torch.equal(s2, s.to(dtype).float())
    # entry [grp, nb, g, 2j + t] is column 64 nb + 16 j + 8 t + g: low half scale, high magic + z
    word = int(sz[1, 2, 5, 2 * 3 + 1]) & 0xFFFFFFFF
    col = 64 * 2 + 16 * 3 + 8 * 1 + 5
    lo = torch.tensor([word & 0xFFFF], dtype=torch.int32).to(torch.int16).view(dtype)
    hi = torch.tensor([word >> 16], dtype=torch.int32).to(torch.int16).view(dtype)
    assert lo.item() == s[1, col].to(dtype).item()
    assert hi.item() == (1024.0 if dtype == torch.float16 else 128.0) + z[1, col].item()


def test_errors_name_the_problem():
    (qw, qz, s), _ = make_awq(64, 16, 32, 0)
    with pytest.raises(ValueError, match="awq scales"):
        W.repack_awq(qw, qz, s[:1], 32)
    (qw, qz, s, g), _ = make_gptq(64, 16, 32, 0, sym=False, v1=False, act_order=False)
    with pytest.raises(ValueError, match="checkpoint_format"):
        W.repack_gptq(qw, qz, s, g, 32, False, "marlin")
    bad = torch.full_like(qz, -1)  # every stored v1 zero 15 -> z = 16
    with pytest.raises(ValueError, match="16"):
        W.repack_gptq(qw, bad, s, g, 32, False, "gptq")
    packed = W.repack_awq(*make_awq(64, 16, 32, 0)[0], 32)
    with pytest.raises(ValueError, match="input features"):
        W.w4a16_matmul(torch.randn(2, 63).half(), packed)


def test_dispatch_picks_kernels_by_m_shape_and_gpu():
    """Pure host logic: which kernel kind serves which M on Hopper and elsewhere."""
    from quantfw.kernels.w4a16.configs import candidate_configs, default_config

    def kind(M, N, K, hopper):
        return default_config(M, N, K, 128, hopper)[0]

    assert [kind(M, 4096, 4096, True) for M in (1, 2, 16, 17, 64, 1024, 2048, 4096)] == (
        ["mma", "mma", "mma", "wg", "wg", "wg", "deq", "deq"]
    )
    for M in (1, 8, 9, 16):  # warps split K inside a CTA (wk > 1) up to 16 tokens
        assert default_config(M, 4096, 4096, 128, True)[6] > 1
    assert {kind(M, 4096, 4096, False) for M in (1, 4, 16, 64)} == {"mma"}
    assert kind(65, 4096, 4096, False) == "deq"
    for M, hopper in [(1, True), (16, True), (17, True), (300, True), (4, False), (300, False)]:
        kinds = {c[0] for c in candidate_configs(M, hopper)}
        assert ("ring" in kinds) == (hopper and M <= 16)
        assert ("wg" in kinds) == (hopper and M > 16)
        assert kinds & {"mma", "deq"}


def test_cpu_path_does_not_import_triton_kernels():
    packed = W.repack_awq(*make_awq(64, 16, 32, 1)[0], 32)
    W.w4a16_matmul(torch.randn(2, 64).half(), packed)
    assert "quantfw.kernels.w4a16.triton.dispatch" not in sys.modules


# --------------------------------------------------------------------------------------------
# GPU: Triton kernels against the fp32 dequantized reference

gpu = pytest.mark.gpu
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _gpu_case(fmt, K, N, G, seed):
    if fmt == "awq":
        (qw, qz, s), ref = make_awq(K, N, G, seed)
        packed = W.repack_awq(qw, qz, s, G)
    else:
        (qw, qz, s, g), ref = make_gptq(
            K, N, G, seed, sym=fmt == "gptq_sym", v1=True, act_order=True
        )
        packed = W.repack_gptq(qw, qz, s, g, G, fmt == "gptq_sym", "gptq")
    return packed.to("cuda"), ref.float().cuda()


def _gpu_check(packed, ref_w, M, dtype, seed, bias=True, config=None):
    from quantfw.kernels.w4a16.triton.dispatch import w4a16_matmul_cuda

    K, N = ref_w.shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
    b = torch.randn(N, device="cuda", generator=gen).to(dtype) if bias else None
    if config is None:
        out = W.w4a16_matmul(x, packed, b)
    else:
        xp = x if packed.perm is None else x.index_select(1, packed.perm)
        out = w4a16_matmul_cuda(xp.contiguous(), packed, b, config=config)
    ref = x.float() @ ref_w + (b.float() if bias else 0)
    assert out.shape == (M, N) and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < TOL[dtype], f"M={M} {dtype} config={config}: rel err {err:.3e}"
    return err


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt,G", [("awq", 128), ("awq", 32), ("gptq_asym", 64), ("gptq_sym", -1)])
def test_gpu_matches_reference(fmt, G, dtype):
    packed, ref_w = _gpu_case(fmt, 640, 392, G, seed=11)
    for i, M in enumerate((1, 3, 16, 37, 300)):
        _gpu_check(packed, ref_w, M, dtype, seed=100 + i)


@gpu
@pytest.mark.parametrize("fmt,K,G", [("awq", 672, 48), ("gptq_sym", 600, -1)])
def test_gpu_odd_chunk_and_unpadded_k(fmt, K, G):
    """G = 48: one k16 step per chunk (x bundles of one step); K = 600: K padded to 608, the
    masked x loads must stop at the true K."""
    packed, ref_w = _gpu_case(fmt, K, 200, G, seed=21)
    for dtype in (torch.float16, torch.bfloat16):
        for M in (1, 5, 12):
            _gpu_check(packed, ref_w, M, dtype, seed=M)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt,K,N,G", [("awq", 640, 392, 128), ("gptq_asym", 600, 200, -1)])
def test_gpu_dequant_path_ragged(fmt, K, N, G, dtype):
    """The ``deq`` path's dense ``[N, K]`` weight, element by element against the reference
    (padded K and N: the stores must stop at the true sizes and write every element), then
    its matmul with bias for every ``deq`` candidate."""
    from quantfw.kernels.w4a16.triton import dispatch as TK

    packed, ref_w = _gpu_case(fmt, K, N, G, seed=31)
    want = W.dequantize_packed(packed, torch.float32).t()
    for cfg in [c for c in TK.candidate_configs(1024) if c[0] == "deq"]:
        got = TK._dequantize(packed, dtype, cfg[1], cfg[2])
        assert got.shape == (N, K) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=1e-3)
        for M in (3, 70):
            _gpu_check(packed, ref_w, M, dtype, seed=M, config=cfg)


@gpu
@pytest.mark.parametrize("M", [1, 2, 4, 16, 64, 300])
def test_gpu_every_candidate_config(M):
    from quantfw.kernels.w4a16.triton import dispatch as TK

    packed, ref_w = _gpu_case("awq", 1024, 768, 128, seed=5)
    x = torch.empty(M, 1024, device="cuda", dtype=torch.float16)
    for cfg in TK.candidate_configs(M, TK._is_hopper(x)):
        _gpu_check(packed, ref_w, M, torch.float16, seed=M, config=cfg)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_split_k_leaves_workspace_clean(dtype):
    """Split-K CTAs meet in a shared fp32 workspace; the last one must leave it zeroed."""
    from quantfw.kernels.w4a16.triton import mma as MK

    packed, ref_w = _gpu_case("awq", 4096, 512, 128, seed=8)
    for M in (1, 16, 40):
        for cps in (4, 16):
            split, _ = MK.plan(M, 512, 4096, torch.device("cuda"), 2, 8, cps, 8 if M <= 8 else 16)
            assert split > 1
            for seed, (pipe, fold) in enumerate([(False, True), (True, True), (False, False)]):
                cfg = ("mma", 2, 8, cps, pipe, fold, 1)
                _gpu_check(packed, ref_w, M, dtype, seed=seed, config=cfg)
            ws, cnt = MK._WORKSPACE[torch.cuda.current_device()]
            assert not ws.any() and not cnt.any()


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_mma_warps_along_k(dtype):
    """``wk`` warps of a CTA per column block sum different k ranges and meet in shared memory,
    with and without CTA split-K on top: ragged column tiles (NB not a multiple of warps / wk),
    K padded to 16 (600) and chunks past the end of K, 8- and 16-token tiles."""
    from quantfw.kernels.w4a16.triton import mma as MK

    configs = [  # warps, chunk, ctas_per_sm, pipe, fold, wk
        (4, 8, 4, False, True, 2),
        (8, 8, 2, True, True, 4),
        (8, 8, 1, False, False, 8),
        (16, 4, 1, False, True, 16),
        (16, 8, 8, False, True, 8),
    ]
    splits = set()
    for fmt, K, N, G in (("awq", 4096, 392, 128), ("gptq_sym", 600, 8256, -1)):
        packed, ref_w = _gpu_case(fmt, K, N, G, seed=9)
        for M in (1, 5, 16, 23):
            for i, (warps, chunk, cps, pipe, fold, wk) in enumerate(configs):
                tm = 8 if M <= 8 else 16
                nb, kb = packed.qweight.shape[:2]
                _, ch = MK.group_steps(packed.group_size, K, kb, chunk, "mma")
                split, _ = MK.plan(
                    M, nb * 64, kb * 16, torch.device("cuda"), warps, ch, cps, tm, wk
                )
                splits.add(split > 1)
                cfg = ("mma", warps, chunk, cps, pipe, fold, wk)
                _gpu_check(packed, ref_w, M, dtype, seed=M + i, config=cfg)
        ws, cnt = MK._WORKSPACE[torch.cuda.current_device()]
        assert not ws.any() and not cnt.any()
    assert splits == {True, False}


def _needs_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma and ring kernels need sm_90")


WG_CONFIGS = [  # tokens, warpgroups (64-column blocks), k16 steps per stage, stages, CTAs/SM
    ("wg", 16, 1, 4, 4, 4),
    ("wg", 32, 2, 4, 4, 8),
    ("wg", 64, 1, 4, 4, 2),
    ("wg", 64, 2, 2, 4, 1),
    ("wg", 128, 2, 2, 6, 1),
    ("wg", 256, 2, 4, 3, 1),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "fmt,K,G",
    [
        ("awq", 640, 128),
        ("awq", 672, 32),
        ("awq", 672, 48),
        ("gptq_sym", 600, -1),
        ("awq", 612, -1),
    ],
)
def test_gpu_wgmma_kernel(fmt, K, G, dtype):
    """Hopper wgmma kernel: every tile shape, ragged M and N (392), group sizes that split a
    stage (32), shrink it (48) or span K (-1); K = 600 is padded to 608 in the packed weights
    and the TMA tiles past K read zeros; K = 612 (rows TMA cannot address) pads x to 616."""
    _needs_hopper()
    packed, ref_w = _gpu_case(fmt, K, 392, G, seed=31)
    for i, cfg in enumerate(WG_CONFIGS):
        for M in (17, 64, 130):
            _gpu_check(packed, ref_w, M, dtype, seed=10 * i + M, config=cfg)


@gpu
def test_gpu_wgmma_split_k_leaves_workspace_clean():
    from quantfw.kernels.w4a16.triton import mma as MK
    from quantfw.kernels.w4a16.triton import wgmma as WK

    _needs_hopper()
    packed, ref_w = _gpu_case("awq", 4096, 520, 128, seed=8)
    small = (("wg", 32, 1, 4, 4, 8), ("wg", 16, 1, 2, 4, 16))
    # M = 300 with 256-token tiles: a ragged last token tile, 9 blocks (N = 520) in 2-block
    # CTAs, so the row-major workspace sees masked rows and columns
    cases = [(M, cfg) for M in (17, 40) for cfg in small] + [(300, ("wg", 256, 2, 4, 4, 1))]
    for M, cfg in cases:
        _, bt, nwg, ks, _, cps = cfg
        tiles = -(-9 // nwg) * -(-M // bt)
        split, _ = WK._plan(4096 // (16 * ks), tiles, MK._num_sms(torch.device("cuda")), cps)
        assert split > 1
        _gpu_check(packed, ref_w, M, torch.float16, seed=M, config=cfg)
        ws, cnt = MK._WORKSPACE[torch.cuda.current_device()]
        assert not ws.any() and not cnt.any()


@gpu
def test_gpu_wgmma_rejects_unsupported_tiles():
    from quantfw.kernels.w4a16.triton.wgmma import w4a16_wgmma_matmul

    _needs_hopper()
    packed, _ = _gpu_case("awq", 1024, 256, 128, seed=3)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.float16)
    sz = packed.scales_zeros_as(x.dtype)
    for kwargs, what in (({"nwg": 4}, "nwg = 4"), ({"ks": 8}, "ks = 8")):
        with pytest.raises(ValueError, match=what):
            w4a16_wgmma_matmul(x, packed.qweight, sz, 256, 128, **kwargs)


RING_CONFIGS = [  # warps (64-column blocks), k16 steps per chunk, ring slots, CTAs/SM
    ("ring", 4, 8, 4, 3),
    ("ring", 4, 4, 2, 8),
    ("ring", 2, 8, 3, 6),
    ("ring", 1, 8, 6, 12),
    ("ring", 1, 2, 4, 16),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "fmt,K,G", [("awq", 640, 128), ("awq", 672, 32), ("awq", 672, 48), ("gptq_sym", 600, -1)]
)
def test_gpu_ring_kernel(fmt, K, G, dtype):
    """Hopper TMA-ring kernel: W = 4 leaves a partial column tile (N = 392: 7 blocks), chunks
    shrink to a group (48: 1 step) or span several (32), K = 600 masks x past the true K and
    TMA reads zero words past the packed K; M covers 8- and 16-token tiles and several tiles.
    (The ring wraps in the split-K test below.)"""
    _needs_hopper()
    packed, ref_w = _gpu_case(fmt, K, 392, G, seed=41)
    for i, cfg in enumerate(RING_CONFIGS):
        for M in (1, 5, 12, 16, 40):
            _gpu_check(packed, ref_w, M, dtype, seed=10 * i + M, config=cfg)


@gpu
def test_gpu_ring_split_k_leaves_workspace_clean():
    from quantfw.kernels.w4a16.triton import mma as MK
    from quantfw.kernels.w4a16.triton import ring as RK

    _needs_hopper()
    packed, ref_w = _gpu_case("awq", 4096, 512, 128, seed=8)
    sms = MK._num_sms(torch.device("cuda"))
    for M in (1, 16, 20):
        for cfg in (("ring", 1, 2, 2, 1), ("ring", 2, 2, 3, 1)):
            tiles = -(-8 // cfg[1]) * -(-M // (8 if M <= 8 else 16))
            split, n_iter = RK.plan(256 // cfg[2], tiles, sms, cfg[4])
            assert split > 1 and n_iter > cfg[3]  # split-K, and the ring wraps
            _gpu_check(packed, ref_w, M, torch.float16, seed=M, config=cfg)
            ws, cnt = MK._WORKSPACE[torch.cuda.current_device()]
            assert not ws.any() and not cnt.any()


@gpu
def test_gpu_irregular_groups_fall_back():
    packed, ref = make_irregular_gptq(256, 64, 7, seed=9)
    _gpu_check(packed.to("cuda"), ref.float().cuda(), 5, torch.float16, seed=1)


@gpu
@pytest.mark.parametrize("M", [1, 16, 128])
def test_gpu_cuda_graph_capture(M):
    packed, ref_w = _gpu_case("gptq_asym", 512, 256, 128, seed=3)
    K, N = ref_w.shape
    x = torch.randn(M, K, device="cuda").half()
    bias = torch.randn(N, device="cuda").half()
    W.w4a16_matmul(x, packed, bias)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = W.w4a16_matmul(x, packed, bias)
    for _ in range(2):
        x.copy_(torch.randn(M, K, device="cuda").half())
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = x.float() @ ref_w + bias.float()
        assert torch.isfinite(out).all()
        assert _rel(out, ref) < 2e-3
