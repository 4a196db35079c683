"""Kernel configs for W4A16 on CUDA: the default per (M, shape, GPU) and the candidates that
``tune()`` times (quantfw/kernels/triton/w4a16_kernels.py).  Pure Python, so the choice is
tested without a GPU or Triton.

Config tuples: ``("mma", warps, chunk, ctas_per_sm, pipe, fold)``, ``("ring", warps, chunk,
stages, ctas_per_sm)``, ``("wg", tokens, warpgroups, ks, stages, ctas_per_sm)``, ``("deq",
k16_steps_per_program, warps)``; docs/kernels-w4a16.md has the measurements behind them.
"""

from __future__ import annotations

MMA_MAX_M = 64
WG_MIN_M = 17  # below this the mma.sync kernel's 8/16-token tiles waste less
RING_MAX_WEIGHTS = 4096 * 4096  # the ring kernel is the default only up to this N x K


def default_config(M: int, N: int, K: int, G: int, hopper: bool = False) -> tuple:
    # the configs the rotated-weights tuner picked most often on H200 (docs/kernels-w4a16.md):
    # at M <= 8 on 6 of 8 shapes (M = 4), at 8 < M <= 16 on 5 of 8; on Hopper, the ring
    # kernel for 2..16 tokens on weights up to 4096 x 4096 (picked on all 6 such rows)
    if hopper and 1 < M < WG_MIN_M and N * K <= RING_MAX_WEIGHTS:
        return RING[0]
    if M < WG_MIN_M or (M <= MMA_MAX_M and not hopper):
        return ("mma", 4, 8, 4, True, True) if M <= 8 else ("mma", 2, 8, 8, False, True)
    if hopper:
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
    mma = [
        ("mma", 2, 8, 8, False, True),
        ("mma", 4, 8, 4, False, True),
        ("mma", 4, 8, 8, False, True),
        ("mma", 8, 8, 4, False, True),
        ("mma", 4, 4, 8, False, True),
        ("mma", 4, 8, 4, True, True),
        ("mma", 2, 8, 8, False, False),
        ("mma", 4, 8, 4, False, False),
    ]
    deq = [("deq", 8, 4), ("deq", 4, 4), ("deq", 16, 8)]
    wg = _WG[_wg_bucket(M)] if hopper and M >= WG_MIN_M else []
    if M < WG_MIN_M and hopper:
        return mma + RING
    if M <= MMA_MAX_M:
        return mma + wg
    if M <= 256:
        return mma[:3] + deq + wg
    return deq + wg
