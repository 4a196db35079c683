"""Run with TRITON_INTERPRET=1 (CPU): our Triton kernels (paged attention, fused small ops) against
the references, at small sizes. Prints one line per check and exits non-zero on a failure."""

from __future__ import annotations

import sys

import torch
from paged_case import make_case
from script_checks import FAILED, check, patch_interpreter_scalar_index, rel

from quantfw.kernels.attention import triton_paged
from quantfw.kernels.fused import reference, triton_ops
from quantfw.layers.attention.backends.triton import TritonBackend


def attention() -> None:
    cases = {
        "decode": dict(cached=[0, 7, 16, 30], new=[1, 1, 1, 1]),
        "prefill": dict(cached=[0, 0], new=[9, 21]),
        "chunked": dict(cached=[8, 3, 0], new=[5, 1, 18]),
    }
    backend = TritonBackend()
    for name, spec in cases.items():
        for window, sinks in ((None, False), (5, False), (None, True), (6, True)):
            for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
                c = make_case(**spec, window=window, sinks=sinks, block_size=4, dtype=dtype)
                meta = c.metadata(backend)
                out = backend.forward(c.layer, c.q, c.k, c.v, meta)
                tag = f"{name} window={window} sinks={sinks} {dtype}"
                check(f"paged attention {tag}", rel(out, c.reference()), tol)
                k_cache, _ = c.layer.kv_cache
                stored = k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mappings[0]]
                check(f"store_kv {tag}", rel(stored, c.k), 0.0)
    # the Triton store kernel alone
    c = make_case(cached=[3, 0], new=[2, 5], block_size=4)
    meta = c.metadata(backend)
    triton_paged.store_kv(c.k, c.v, *c.layer.kv_cache, meta.slot_mappings[0])
    k_cache, v_cache = c.layer.kv_cache
    rows = meta.slot_mappings[0]
    err = max(rel(k_cache.view(-1, 2, 16)[rows], c.k), rel(v_cache.view(-1, 2, 16)[rows], c.v))
    check("triton store_kv", err, 0.0)
    # every split count gives the same decode result (spans, empty spans, the merge)
    c = make_case(cached=[0, 40, 90], new=[1, 1, 1], block_size=8, sinks=True, window=50)
    meta = c.metadata(backend)
    backend.forward(c.layer, c.q, c.k, c.v, meta)  # stores the new keys
    ref = c.reference()
    for splits in (1, 2, 3, 7, 32):
        out = triton_paged.paged_decode(
            c.q, *c.layer.kv_cache, meta.block_tables[0], meta.context_lens, c.layer.scale,
            num_splits=splits, sliding_window=50, sinks=c.layer.sinks,
        )  # fmt: skip
        check(f"decode num_splits={splits}", rel(out, ref), 1e-5)
    # spans of several 64-key tiles: the first read before the wait (the new key after it),
    # the others in the loop; the new key in the first tile, a later one, or past every span
    c = make_case(cached=[0, 70, 150], new=[1, 1, 1], block_size=8, sinks=True)
    meta = c.metadata(backend)
    backend.forward(c.layer, c.q, c.k, c.v, meta)
    ref = c.reference()
    for splits in (1, 2, 32):
        out = triton_paged.paged_decode(
            c.q, *c.layer.kv_cache, meta.block_tables[0], meta.context_lens, c.layer.scale,
            num_splits=splits, sinks=c.layer.sinks,
        )  # fmt: skip
        check(f"decode of several tiles num_splits={splits}", rel(out, ref), 1e-5)


def fused() -> None:
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3)):
        x, r = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
        w = torch.randn(96, dtype=dtype)
        for f32 in (False, True):
            kw = dict(weight_in_float32=f32)
            check(
                f"rms_norm weight_in_float32={f32} {dtype}",
                rel(triton_ops.rms_norm(x, w, 1e-6, **kw), reference.rms_norm(x, w, 1e-6, **kw)),
                tol,
            )
            (a, ar) = triton_ops.rms_norm(x, w, 1e-6, r, **kw)
            (b, br) = reference.rms_norm(x, w, 1e-6, r, **kw)
            check(
                f"add + rms_norm weight_in_float32={f32} {dtype}", max(rel(a, b), rel(ar, br)), tol
            )
        y = torch.randn(3, 4, 160, dtype=dtype)
        check(
            f"silu_and_mul {dtype}", rel(triton_ops.silu_and_mul(y), reference.silu_and_mul(y)), tol
        )
        for group in (16, 40):  # a gated pair's output interleaved in groups
            y_il = reference.interleave_gate_up(y, group, dim=-1)
            check(
                f"silu_and_mul interleave={group} {dtype}",
                rel(triton_ops.silu_and_mul(y_il, group), reference.silu_and_mul(y)),
                tol,
            )
            check(
                f"swiglu_oai interleave={group} {dtype}",
                rel(
                    triton_ops.swiglu_oai(y_il, 1.702, 7.0, group),
                    reference.swiglu_oai(y, 1.702, 7.0),
                ),
                tol,
            )
        y2 = torch.randn(3, 192, dtype=dtype)  # 96 outputs: three blocks of 32
        y2_il = reference.interleave_gate_up(y2, 16, dim=-1)
        check(  # written in the MXFP4 wgmma kernel's input order
            f"silu_and_mul pairs_transposed {dtype}",
            rel(
                triton_ops.silu_and_mul(y2_il, 16, True),
                reference.transpose_pairs(reference.silu_and_mul(y2)),
            ),
            tol,
        )
        check(
            f"swiglu_oai pairs_transposed {dtype}",
            rel(
                triton_ops.swiglu_oai(y2, 1.702, 7.0, 0, True),
                reference.transpose_pairs(reference.swiglu_oai(y2, 1.702, 7.0)),
            ),
            tol,
        )
        for rot, norm in ((64, True), (48, True), (32, False)):
            qkv = torch.randn(1, 7, 10 * 64, dtype=dtype)
            q, k = qkv[..., : 6 * 64].view(1, 7, 6, 64), qkv[..., 6 * 64 : 8 * 64].view(1, 7, 2, 64)
            inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
            f = torch.randint(0, 4000, (1, 7)).float()[..., None] * inv
            cs = torch.cat((f.cos(), f.sin()), -1)
            qw = torch.randn(64, dtype=dtype) if norm else None
            kw = torch.randn(64, dtype=dtype) if norm else None
            rq, rk = reference.qk_norm_rope(q.clone(), k.clone(), cs, rot, qw, kw, 1e-6)
            tq, tk = triton_ops.qk_norm_rope(q, k, cs, rot, qw, kw, 1e-6)
            in_place = torch.equal(qkv[..., : 6 * 64].view(1, 7, 6, 64), tq)
            check(f"qk_norm_rope rot={rot} norm={norm} {dtype}", max(rel(tq, rq), rel(tk, rk)), tol)
            check(f"qk_norm_rope in place rot={rot}", 0.0 if in_place else 1.0, 0.0)
            # fused with the cache store: rotated keys and the values land at their slots
            caches = [torch.randn(5, 4, 2, 64, dtype=dtype) for _ in range(2)]
            caches += [c.clone() for c in caches]
            slots = torch.randperm(20)[:7]
            qkv2 = torch.randn_like(qkv)
            q2, k2 = (
                qkv2[..., : 6 * 64].view(1, 7, 6, 64),
                qkv2[..., 6 * 64 : 8 * 64].view(1, 7, 2, 64),
            )
            v2 = qkv2[..., 8 * 64 :].view(1, 7, 2, 64)
            rq2, _ = reference.qk_norm_rope(
                q2.clone(), k2.clone(), cs, rot, qw, kw, 1e-6, (v2, caches[0], caches[1], slots)
            )
            tq2, _ = triton_ops.qk_norm_rope(
                q2, k2, cs, rot, qw, kw, 1e-6, (v2, caches[2], caches[3], slots)
            )
            err = max(rel(tq2, rq2), rel(caches[2], caches[0]), rel(caches[3], caches[1]))
            check(f"qk_norm_rope + store rot={rot} norm={norm} {dtype}", err, tol)


def gemv() -> None:
    from quantfw.kernels.common import splitk
    from quantfw.kernels.dense.gemv import dense_gemv

    g = torch.Generator().manual_seed(5)
    # N not a multiple of the column tile, K not of the K step, weight rows with a stride; the
    # interpreter's "GPU" has 4 SMs, so the first three split K (5, 3 and 8 CTAs a tile), the
    # next two split K with several steps a split (6 x 2, 4 x 3: the prefetch loop under
    # split-K), the last runs 8 steps in one CTA
    for n, k, cfg in ((70, 300, dict(block_n=32, block_k=64)),
                      (40, 96, dict(block_n=16, block_k=32, ctas_per_sm=4)),
                      (33, 1000, dict(block_n=16, block_k=128, ctas_per_sm=8)),
                      (5, 700, dict(block_n=4, block_k=64, ctas_per_sm=3)),
                      (31, 5000, dict(block_n=4, block_k=512, ctas_per_sm=8)),
                      (33, 1000, dict(block_n=16, block_k=128, ctas_per_sm=1))):  # fmt: skip
        for bias in (True, False):
            w = torch.randn(n, k + 5, generator=g)[:, :k]  # a row stride past K
            x = torch.randn(1, k, generator=g)
            b = torch.randn(n, generator=g) if bias else None
            ref = x.double() @ w.double().T + (b.double() if bias else 0)
            first = dense_gemv(x, w, b, **cfg)
            again = dense_gemv(x, w, b, **cfg)  # finds the workspace zeroed again
            check(f"dense_gemv N={n} K={k} {cfg} bias={bias}", rel(first, ref), 1e-6)
            check("dense_gemv: the same bits twice", 0.0 if torch.equal(first, again) else 1.0, 0.0)
            ws, cnt = splitk.WORKSPACE.get("cpu", (torch.zeros(1), torch.zeros(1)))
            check("dense_gemv leaves the workspace clean", float(ws.any() or cnt.any()), 0.0)


def gemv_rope_store() -> None:
    """The GEMV's rotary epilogue writes what the GEMV and then the rotary-and-store kernel
    write: q rotated, k rotated and v at the cache row, the same bits, with and without a split
    along K (the interpreter's "GPU" has 4 SMs: the last case splits K five ways), with and
    without a bias, with heads that straddle column tiles (block_n 4 over head_dim 6)."""
    from quantfw.kernels.dense.gemv import dense_gemv
    from quantfw.kernels.dense.ops import QkvRopeStore
    from quantfw.kernels.fused import triton_ops

    g = torch.Generator().manual_seed(6)
    for nh, nkv, d, k, cfg, dtype in (
        (4, 2, 16, 96, dict(block_n=4, block_k=32, ctas_per_sm=2), torch.float32),
        (6, 2, 8, 200, dict(block_n=4, block_k=64, ctas_per_sm=8), torch.float16),
        (4, 1, 16, 64, dict(block_n=2, block_k=32, ctas_per_sm=1), torch.float32),
        (5, 1, 6, 80, dict(block_n=4, block_k=16, ctas_per_sm=1), torch.float16),
        (2, 1, 8, 160, dict(block_n=4, block_k=16, ctas_per_sm=16), torch.float32),
    ):
        n = (nh + 2 * nkv) * d
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(1, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if d != 16 else None  # d = 16: no bias
        angles = 11.0 * 10000 ** (-torch.arange(0, d, 2).double() / d)
        cs = torch.cat((angles.cos(), angles.sin())).float()
        k_cache = torch.randn(3, 4, nkv, d, generator=g).to(dtype)
        v_cache = torch.randn(3, 4, nkv, d, generator=g).to(dtype)
        k_twin, v_twin = k_cache.clone(), v_cache.clone()
        slot = torch.tensor([6])
        store = QkvRopeStore(cs, slot, k_cache, v_cache, nh, nkv, d)
        q = dense_gemv(x, w, b, rope_store=store, **cfg)
        qkv = dense_gemv(x, w, b, **cfg)
        tq, tk, tv = (
            t.reshape(1, -1, d).clone() for t in qkv.split([nh * d, nkv * d, nkv * d], -1)
        )
        flat = (k_twin.view(-1, nkv, d), v_twin.view(-1, nkv, d), slot)
        triton_ops.qk_norm_rope(tq, tk, cs, d, None, None, 0.0, store=(tv, *flat))
        same = torch.equal(q.view(1, nh, d), tq) and torch.equal(k_cache, k_twin)
        same = same and torch.equal(v_cache, v_twin)
        check(
            f"dense_gemv rotary epilogue heads {nh}+{nkv} d={d} {cfg} {dtype}",
            0.0 if same else 1.0,
            0.0,
        )
        # against float64: y = W x + b, rotate-half with the same angles
        y = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
        heads = y.view(-1, d)
        x1, x2 = heads[:, : d // 2], heads[:, d // 2 :]
        c, s_ = angles.cos(), angles.sin()
        rot = torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), -1)
        tol = 1e-6 if dtype == torch.float32 else 2e-3
        check("dense_gemv rotary epilogue q against float64", rel(q.view(nh, d), rot[:nh]), tol)
        check("... k against float64", rel(k_cache.view(-1, nkv, d)[6], rot[nh : nh + nkv]), tol)
        check("... v against float64", rel(v_cache.view(-1, nkv, d)[6], heads[nh + nkv :]), tol)


if __name__ == "__main__":
    patch_interpreter_scalar_index()
    attention()
    fused()
    gemv()
    gemv_rope_store()
    sys.exit(1 if FAILED else 0)
