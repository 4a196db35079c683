"""Kernel configs for W4A16 on CUDA: the default per (M, shape, GPU) and the candidates that
``tune()`` times (quantfw/kernels/w4a16/triton/dispatch.py).  Pure Python, so the choice is
tested without a GPU or Triton.

Config tuples: ``("mma", warps, chunk, ctas_per_sm, pipe, fold, wk)``, ``("ring", warps, chunk,
stages, ctas_per_sm)``, ``("wg", tokens, warpgroups, ks, stages, ctas_per_sm)``, ``("deq",
k16_steps_per_program, warps)``. The defaults and candidates were chosen from H200
measurements (benchmarks/w4a16-lab-log.md).
"""

from __future__ import annotations

from quantfw.kernels.common.tables import check_fields, m_bucket

__all__ = ["CONFIG_FIELDS", "candidate_configs", "check_config", "default_config", "m_bucket"]

MMA_MAX_M = 64
WG_MIN_M = 17  # below this the mma.sync kernel's 8/16-token tiles waste less
DEQ_MIN_M_HOPPER = 2048  # tune() picked deq + cuBLAS on all 8 H200 shapes at M = 4096

#: kind -> (field names after the kind, their types); bool fields take only True/False
CONFIG_FIELDS: dict[str, tuple[tuple[str, type], ...]] = {
    "mma": (("warps", int), ("chunk", int), ("ctas_per_sm", int), ("pipe", bool),
            ("fold", bool), ("wk", int)),
    "ring": (("warps", int), ("chunk", int), ("stages", int), ("ctas_per_sm", int)),
    "wg": (("tokens", int), ("warpgroups", int), ("ks", int), ("stages", int),
           ("ctas_per_sm", int)),
    "deq": (("k16_steps", int), ("warps", int)),
}  # fmt: skip


def check_config(cfg: tuple, where: str = "w4a16 config") -> tuple:
    """``cfg`` if it is a well-formed config tuple; a ValueError naming ``where`` otherwise."""
    return check_fields(cfg, CONFIG_FIELDS, where)


def default_config(M: int, N: int, K: int, G: int, hopper: bool = False) -> tuple:
    # the mma configs with the lowest mean ratio to the best one over the probed H200 rows
    if M <= 8:
        return MMA_SMALL[0]
    if M < WG_MIN_M:
        return MMA_SMALL[1]
    if M <= MMA_MAX_M and not hopper:
        return MMA[0]
    if hopper and M < DEQ_MIN_M_HOPPER:
        return _WG_DEFAULT[_wg_bucket(M)]
    return ("deq", 8, 4)


_WG = {  # ("wg", tokens per CTA, warpgroups (64-column blocks), ks, stages, ctas_per_sm)
    32: [("wg", 32, 1, 4, 4, 4), ("wg", 32, 1, 4, 4, 8), ("wg", 32, 2, 4, 4, 4)],
    64: [("wg", 64, 1, 4, 4, 2), ("wg", 64, 1, 4, 4, 4), ("wg", 64, 2, 4, 4, 2)],
    128: [("wg", 128, 1, 4, 4, 2), ("wg", 128, 2, 4, 4, 1), ("wg", 64, 2, 4, 4, 2)],
    256: [("wg", 128, 2, 4, 4, 1), ("wg", 256, 2, 4, 3, 1), ("wg", 256, 2, 4, 4, 1)],
    1024: [
        ("wg", 256, 2, 4, 4, 1),
        ("wg", 256, 2, 4, 3, 1),
        ("wg", 256, 2, 4, 5, 1),
        ("wg", 128, 2, 4, 4, 1),
    ],
}
_WG_DEFAULT = {32: _WG[32][0], 64: _WG[64][0], 128: _WG[128][1], 256: _WG[256][0]}
_WG_DEFAULT[1024] = _WG[1024][0]


# ("mma", warps, k16 steps per chunk, ctas_per_sm, pipe, fold, wk (warps per column block))
MMA_SMALL = [  # M <= 16: every probed H200 row has one within 3% of its best
    ("mma", 4, 8, 8, False, True, 4),
    ("mma", 8, 4, 2, False, True, 8),
    ("mma", 16, 4, 1, False, True, 16),
    ("mma", 4, 8, 4, False, True, 2),
    ("mma", 8, 8, 2, False, True, 8),
    ("mma", 16, 4, 2, False, True, 8),
    ("mma", 4, 8, 4, True, True, 1),
    ("mma", 8, 4, 4, False, True, 4),
    ("mma", 8, 8, 4, False, True, 4),
]
MMA = [  # 17..64 tokens (and the first 3 up to 256): the best mean ratios at M = 32 and 64
    ("mma", 8, 4, 2, False, True, 8),
    ("mma", 4, 8, 4, False, True, 2),
    ("mma", 16, 4, 2, False, True, 8),
    ("mma", 2, 8, 8, False, True, 1),
    ("mma", 8, 8, 2, False, True, 8),
    ("mma", 4, 8, 8, False, True, 4),
]

RING = [  # ("ring", warps (64-column blocks), k16 steps per chunk, stages, ctas_per_sm)
    ("ring", 4, 8, 3, 4),
    ("ring", 2, 8, 3, 8),
    ("ring", 1, 8, 4, 12),
    ("ring", 2, 8, 6, 4),
    ("ring", 1, 8, 6, 8),
]


def _wg_bucket(M: int) -> int:
    return next(b for b in _WG if b >= M or b == 1024)


def candidate_configs(M: int, hopper: bool = False) -> list[tuple]:
    """The small set tried by tune() for one M bucket (``hopper``: add the ring kernel's
    configs up to 16 tokens, the wgmma kernel's above)."""
    deq = [("deq", 8, 4), ("deq", 4, 4)]
    wg = _WG[_wg_bucket(M)] if hopper and M >= WG_MIN_M else []
    if M < WG_MIN_M:
        return MMA_SMALL + RING if hopper else MMA_SMALL
    if M <= MMA_MAX_M:
        return MMA + wg
    if M <= 256:
        return MMA[:3] + deq + wg
    return deq + wg
