"""Mixture-of-experts compute that does not depend on the weight format: router top-k
(``routing``), the token sort by expert with its ``m_indptr`` and the weighted combine
(``sort``), and the CPU path that runs one expert at a time (``reference``). The GPU grouped
GEMMs live with their weight format (`quantfw.kernels.mxfp4.triton`, dense and MXFP4 weights).
"""

from quantfw.kernels.moe.reference import experts_forward_cpu
from quantfw.kernels.moe.routing import SCORING_FUNCTIONS, select_experts
from quantfw.kernels.moe.sort import ExpertSort, combine, sort_by_expert

__all__ = [
    "SCORING_FUNCTIONS",
    "ExpertSort",
    "combine",
    "experts_forward_cpu",
    "select_experts",
    "sort_by_expert",
]
