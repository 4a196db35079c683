"""Kernel configs for kbit on CUDA: the default per (M, shape) and the candidates ``tune()``
times (quantfw/kernels/kbit/triton/dispatch.py). Pure Python, so the choice is tested without
a GPU or Triton.

Config tuples:

* ``("mma", warps, chunk, ctas_per_sm, copies, pipe)`` (few tokens):
  ``kbit_mma_kernel`` (``triton/mma.py``: codebook lookups from a shared-memory table into
  ``mma.sync`` fragments), ``warps`` 64-column blocks per CTA, ``chunk`` blocks of 32 per K
  step (4 or 8), split-K chosen to fill ``ctas_per_sm`` CTAs per SM, ``copies`` of the table
  (1..32) against bank conflicts, ``pipe``: the next chunk's loads issued before this one's
  math;
* ``("fused", block_m, block_n, block_k, warps, stages, ctas_per_sm, swap)``:
  ``kbit_gemm_kernel`` (weights decoded tile by tile in registers, ``tl.dot``), ``block_m``
  tokens (>= 16), ``block_n`` columns (16..128, dividing the layout's N padding of 128),
  ``block_k`` inputs (128 or 256: whole quads of blocks, dividing the K padding of 256);
  split-K chosen to fill
  ``ctas_per_sm`` CTAs per SM; ``swap``: compute ``W @ x.T`` (the decoded weight tile is the
  MMA's first operand, read from registers by Hopper's wgmma; block_n fills its M >= 64);
* ``("deq", block_n, block_k, warps)``: ``kbit_dequant_kernel`` writes a transient dense
  ``[N, K]`` weight in the activation dtype, then cuBLAS (``F.linear``);
* ``("wgmma", block_tokens, stages, chunk)`` (sm_90): ``triton/wgmma.py``, the Hopper
  kernel of ``mxfp4/triton/wgmma.py`` (codebook lookups by ``prmt`` into wgmma's register
  operand, x tiles by TMA), ``block_tokens`` (64, 128, 256) rows per CTA in wgmma chunks of
  ``chunk`` rows (a chunk past the last row is skipped), ``stages`` deep. Two launches and
  about 100 us of host time a call, so chosen by default only for calls made for CUDA graphs
  (`common.launch_mode`: the engine's decode batches), where launches are replayed.
"""

from __future__ import annotations

from quantfw.kernels.common.tables import check_fields, m_bucket

__all__ = ["CONFIG_FIELDS", "candidate_configs", "check_config", "default_config", "m_bucket"]

CONFIG_FIELDS: dict[str, tuple[tuple[str, type], ...]] = {
    "mma": (("warps", int), ("chunk", int), ("ctas_per_sm", int), ("copies", int),
            ("pipe", bool)),
    "fused": (("block_m", int), ("block_n", int), ("block_k", int), ("warps", int),
              ("stages", int), ("ctas_per_sm", int), ("swap", bool)),
    "deq": (("block_n", int), ("block_k", int), ("warps", int)),
    "wgmma": (("block_tokens", int), ("stages", int), ("chunk", int)),
}  # fmt: skip

BLOCK_KS = (128, 256)  # whole quads of blocks (layout.QUAD * 32) dividing layout.PAD_K
#: the largest M the fused kernel serves by default; larger M dequantizes and calls cuBLAS
FUSED_DEFAULT_MAX_M = 128
#: bits the mma kernel serves (2- and 4-bit fields; K = 3, 5 add a 1-bit word), and the
#: largest M it serves by default
MMA_BITS = (2, 3, 4, 5)
MMA_DEFAULT_MAX_M = 16
#: the wgmma kernel's configs (sm_90, every K): 64-, 128- and 256-token tiles
WGMMA_64, WGMMA_128, WGMMA_256 = (
    ("wgmma", 64, 4, 64),
    ("wgmma", 128, 3, 128),
    ("wgmma", 256, 3, 256),
)
#: weights (N * K) from which 256-token tiles win at 129..256 tokens, and N from which they
#: win over dequantize + cuBLAS up to 1024 tokens (256 at K = 5, whose decode costs more)
#: (H200, benchmarks/kbit-lab-log.md §20, §21)
WGMMA_256_MIN_WEIGHTS = 32 * 2**20
WGMMA_WIDE_MIN_N = 16384
WGMMA_MAX_M = {2: 1024, 3: 1024, 4: 1024, 5: 256}


def _mma_copies(bits: int) -> int:
    """Table copies: one per bank for the one-word entries of K = 3, 4 (32) and the two-word
    ones of K = 2 (16); K = 5's 1024 entries take 8 (32 KB, as K = 4's table)."""
    return {2: 16, 3: 32, 4: 32, 5: 8}[bits]


def _mma_default(M: int, bits: int) -> tuple:
    """The mma kernel's default: table copies per `_mma_copies`; a token tile of 8 fits 3
    CTAs of 4 warps per SM at K = 2, 4 (about 130-170 registers), a tile of 16 (9-16 tokens)
    2 (about 206), and K = 3, 5 2 (a second bundle of words per column: 210-250 registers;
    K = 5 with its scale words staged by TMA takes 168-185, but planning for 3 was no faster,
    kbit-lab-log §26); planning the split for exactly that many keeps the grid to one wave
    (H200, benchmarks/kbit-lab-log.md §5; 16-token tiles planned for 4 ran up to 1.3x slower,
    §27). `mma.staged_tile16` may stage the 16-token tile instead, capped at 168 registers and
    planned for 3 (§33)."""
    if bits in (3, 5):
        return ("mma", 4, 4, 2, _mma_copies(bits), False)
    return ("mma", 4, 4, 3 if M <= 8 else 2, _mma_copies(bits), False)


def wgmma_tile(M: int, N: int, K: int, bits: int) -> tuple | None:
    """The wgmma kernel's config for M > 16 tokens (sm_90) where it beat the other paths at
    Qwen3-8B's shapes (H200, every K): every shape to 128 tokens, then the large weights
    (256-token tiles) to 256, then only the widest (gate_up) to `WGMMA_MAX_M`; None elsewhere
    (and to 16 tokens, the mma kernel's)."""
    if M <= MMA_DEFAULT_MAX_M:
        return None
    if M <= 64:
        return WGMMA_64
    if M <= 128:
        return WGMMA_128
    large = M <= 256 and N * K >= WGMMA_256_MIN_WEIGHTS
    wide = N >= WGMMA_WIDE_MIN_N and WGMMA_MAX_M[bits] >= M
    if large or wide:
        return WGMMA_256
    return None


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def check_config(cfg: tuple, where: str = "kbit config") -> tuple:
    """``cfg`` if it is a well-formed kbit config; a ValueError naming ``where`` otherwise."""
    cfg = check_fields(cfg, CONFIG_FIELDS, where)
    fields = dict(zip((n for n, _ in CONFIG_FIELDS[cfg[0]]), cfg[1:]))
    if cfg[0] == "wgmma":
        bt, chunk = fields["block_tokens"], fields["chunk"]
        if bt not in (64, 128, 256) or chunk < 32 or bt % chunk or bt // chunk > 4:
            raise ValueError(
                f"{where}: block_tokens={bt}, chunk={chunk}: tiles of 64, 128 or 256 rows in "
                "1, 2 or 4 chunks of at least 32"
            )
        if not 2 <= fields["stages"] <= 6:
            raise ValueError(f"{where}: stages={fields['stages']} must be 2..6")
        return cfg
    if cfg[0] == "mma":
        if fields["warps"] not in (1, 2, 4, 8):
            raise ValueError(f"{where}: warps={fields['warps']} must be 1, 2, 4 or 8")
        if fields["chunk"] not in (4, 8):
            raise ValueError(f"{where}: chunk={fields['chunk']} must be 4 or 8 blocks")
        if fields["copies"] not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"{where}: copies={fields['copies']} must be a power of two <= 32")
        return cfg
    if fields["block_n"] > 128 or not _pow2(fields["block_n"]) or fields["block_n"] < 16:
        raise ValueError(f"{where}: block_n={fields['block_n']} must be 16, 32, 64 or 128")
    if fields["block_k"] not in BLOCK_KS:
        raise ValueError(f"{where}: block_k={fields['block_k']} must be 128 or 256")
    if "block_m" in fields and (fields["block_m"] < 16 or not _pow2(fields["block_m"])):
        raise ValueError(f"{where}: block_m={fields['block_m']} must be 16, 32, 64, ...")
    return cfg


def default_config(M: int, N: int, K: int, bits: int, wgmma: bool = False) -> tuple:
    """The heuristic config of an untuned call (few tokens: the mma kernel; beyond, where the
    wgmma kernel may run (`wgmma`: sm_90, launches replayed from CUDA graphs): that kernel;
    elsewhere up to ``FUSED_DEFAULT_MAX_M``: fused, then dequantize + cuBLAS)."""
    if M <= MMA_DEFAULT_MAX_M and bits in MMA_BITS:
        return _mma_default(M, bits)
    if wgmma:
        tile = wgmma_tile(M, N, K, bits)
        if tile is not None:
            return tile
    if M <= 16:
        return ("fused", 16, 128, 128, 8, 1, 4, True)
    if M <= 32:
        return ("fused", 32, 128, 128, 8, 1, 2, True)
    if M <= 64:
        return ("fused", 64, 128, 128, 8, 1, 2, True)
    if M <= FUSED_DEFAULT_MAX_M:
        return ("fused", 64, 128, 128, 4, 1, 2, False)
    return ("deq", 128, 128, 8)


def candidate_configs(M: int, bits: int = 4, wgmma: bool = False) -> list[tuple]:
    """The small set tried by tune() for one M bucket and bit width (the default first;
    `wgmma`: with the wgmma kernel's configs from 16 tokens)."""
    deq = [("deq", 128, 128, 8), ("deq", 64, 256, 4)]
    if M <= 16:
        cands = [
            ("fused", 16, 128, 128, 8, 3, 4, True),
            ("fused", 16, 64, 256, 4, 3, 4, True),
            ("fused", 16, 128, 256, 8, 2, 2, True),
            # unpipelined: Triton's pipeliner turns the K >= 3 codebook gather into one 4-byte
            # cp.async per element (sm_90 PTX), stages 1 keeps it a plain L1-hit load
            ("fused", 16, 128, 128, 8, 1, 4, True),
            ("fused", 16, 64, 128, 4, 3, 4, False),
        ]
    elif M <= 64:
        cands = [
            ("fused", 32, 128, 128, 8, 3, 2, True),
            ("fused", 64, 128, 128, 8, 3, 2, True),
            ("fused", 32, 64, 128, 4, 3, 4, False),
            ("fused", 64, 64, 128, 4, 3, 2, False),
        ] + deq[:1]
    elif M <= 256:
        cands = [
            ("fused", 64, 128, 128, 4, 3, 2, False),
            ("fused", 128, 128, 128, 8, 2, 1, False),
        ] + deq[:1]
    else:
        cands = [("fused", 128, 128, 128, 8, 2, 1, False)] + deq
    if M <= 64 and bits in MMA_BITS:
        cands = [
            _mma_default(1, bits),
            _mma_default(16, bits),
            ("mma", 4, 4, 4, 1, False),
            ("mma", 4, 4, 2, _mma_copies(bits), False),
            ("mma", 4, 4, 4, _mma_copies(bits), True),
            ("mma", 4, 8, 4, 4, True),
        ] + cands
    if wgmma and M >= 16:
        cands += [WGMMA_64, ("wgmma", 128, 3, 64), WGMMA_128, WGMMA_256]
    return list(dict.fromkeys([default_config(M, 0, 0, bits, wgmma)] + cands))
