"""Kernel configs for kbit on CUDA: the default per (M, shape) and the candidates ``tune()``
times (quantfw/kernels/kbit/triton/dispatch.py). Pure Python, so the choice is tested without
a GPU or Triton.

Config tuples:

* ``("fused", block_m, block_n, block_k, warps, stages, ctas_per_sm)``: ``kbit_gemm_kernel``
  (weights dequantized tile by tile in registers, ``tl.dot``), ``block_m`` tokens (>= 16),
  ``block_n`` columns (dividing 128), ``block_k`` a multiple of 64; split-K chosen to fill
  ``ctas_per_sm`` CTAs per SM;
* ``("deq", block_n, block_k, warps)``: ``kbit_dequant_kernel`` writes a transient dense
  ``[N, K]`` weight in the activation dtype, then cuBLAS (``F.linear``).
"""

from __future__ import annotations

from quantfw.kernels.common.tables import check_fields, m_bucket

__all__ = ["CONFIG_FIELDS", "candidate_configs", "check_config", "default_config", "m_bucket"]

CONFIG_FIELDS: dict[str, tuple[tuple[str, type], ...]] = {
    "fused": (("block_m", int), ("block_n", int), ("block_k", int), ("warps", int),
              ("stages", int), ("ctas_per_sm", int)),
    "deq": (("block_n", int), ("block_k", int), ("warps", int)),
}  # fmt: skip


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def check_config(cfg: tuple, where: str = "kbit config") -> tuple:
    """``cfg`` if it is a well-formed kbit config; a ValueError naming ``where`` otherwise."""
    cfg = check_fields(cfg, CONFIG_FIELDS, where)
    fields = dict(zip((n for n, _ in CONFIG_FIELDS[cfg[0]]), cfg[1:]))
    if fields["block_n"] > 128 or not _pow2(fields["block_n"]) or fields["block_n"] < 16:
        raise ValueError(f"{where}: block_n={fields['block_n']} must be 16, 32, 64 or 128")
    if fields["block_k"] % 64 or not _pow2(fields["block_k"]):
        raise ValueError(f"{where}: block_k={fields['block_k']} must be 64, 128, 256, ...")
    if "block_m" in fields and (fields["block_m"] < 16 or not _pow2(fields["block_m"])):
        raise ValueError(f"{where}: block_m={fields['block_m']} must be 16, 32, 64, ...")
    return cfg


#: The fused kernel is wrong on sm_90 for more than one token (H200, 2026-11-23: relative error
#: 0.05-0.57 at M = 7..300, right at M = 1 and under Triton's interpreter; see
#: benchmarks/results/kbit-gpu-tests-NVIDIA_H200-2026-11-23.log). Until it is fixed, only M = 1
#: runs it; every other M dequantizes and calls cuBLAS.
FUSED_MAX_M = 1


def default_config(M: int, N: int, K: int, bits: int) -> tuple:
    if M <= FUSED_MAX_M:
        return ("fused", 16, 64, 128, 4, 2, 4)
    return ("deq", 128, 128, 8)


def candidate_configs(M: int) -> list[tuple]:
    """The small set tried by tune() for one M bucket (fused only where it is correct)."""
    deq = [("deq", 128, 128, 8), ("deq", 64, 256, 4)]
    if M > FUSED_MAX_M:
        return deq
    if M <= 16:
        return [
            ("fused", 16, 64, 128, 4, 2, 4),
            ("fused", 16, 64, 128, 4, 1, 4),
            ("fused", 16, 32, 128, 4, 2, 8),
            ("fused", 16, 64, 256, 4, 1, 4),
            ("fused", 16, 128, 64, 4, 2, 4),
            ("fused", 16, 32, 256, 2, 1, 8),
            ("fused", 16, 64, 64, 2, 3, 8),
        ]
    if M <= 64:
        return [
            ("fused", 32, 64, 64, 4, 2, 4),
            ("fused", 64, 64, 64, 4, 2, 2),
            ("fused", 64, 128, 64, 8, 2, 2),
            ("fused", 32, 64, 128, 4, 2, 4),
        ] + deq[:1]
    return [
        ("fused", 128, 128, 64, 8, 2, 1),
        ("fused", 64, 128, 64, 4, 2, 2),
        ("fused", 128, 64, 64, 4, 3, 1),
    ] + deq
