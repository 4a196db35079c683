"""Mixture-of-experts compute that does not depend on the weight format: router top-k
(``routing``), the token sort by expert with its ``m_indptr`` and the weighted combine
(``sort``, with the row blocks a grouped GEMM launches over), and the CPU path that runs one expert at a time (``reference``). The GPU grouped
GEMMs live with their weight format (`quantfw.kernels.mxfp4.triton`, dense and MXFP4 weights).
"""

from quantfw.kernels.moe.reference import experts_forward_cpu
from quantfw.kernels.moe.routing import SCORING_FUNCTIONS, select_experts
from quantfw.kernels.moe.sort import (
    BlockPlan,
    ExpertSort,
    block_schedule,
    combine,
    single_group,
    sort_by_expert,
)

__all__ = [
    "SCORING_FUNCTIONS",
    "BlockPlan",
    "block_schedule",
    "single_group",
    "ExpertSort",
    "combine",
    "experts_forward_cpu",
    "select_experts",
    "sort_by_expert",
]
