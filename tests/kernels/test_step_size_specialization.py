"""Kernels that eager steps launch with sizes that change from step to step (an eager step's
widest block table, a MoE step's assignments, blocks and chunks) take those sizes unspecialized:
otherwise Triton compiles a variant the first time one of them is 1 or a multiple of 16, in the
middle of serving. (The stalls `benchmarks/bench_serving.py` measured came from the step
payload's pointer alignment, `tests/engine/test_step_packing.py`; decode-lab-log experiment 28.)"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from quantfw.kernels.attention import triton_paged  # noqa: E402
from quantfw.kernels.mxfp4.triton import sort  # noqa: E402

PER_STEP = {
    triton_paged._paged_prefill_kernel: {"bt_stride"},
    triton_paged._paged_decode_kernel: {"bt_stride"},
    sort._align_kernel: {"num_rows", "num_blocks"},
    sort._chunk_counts_kernel: {"num_rows"},
    sort._chunk_prefix_kernel: {"n_chunks"},
    sort._sort_chunks_kernel: {"num_rows", "num_blocks", "n_chunks"},
}


@pytest.mark.parametrize("kernel", list(PER_STEP), ids=lambda k: k.__name__)
def test_per_step_sizes_are_not_specialized(kernel):
    unspecialized = {p.name for p in kernel.params if p.do_not_specialize}
    assert PER_STEP[kernel] <= unspecialized, PER_STEP[kernel] - unspecialized
