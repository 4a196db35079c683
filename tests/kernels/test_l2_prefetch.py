"""`kernels.common.l2_prefetch` on the CPU: the slices tile a tensor's bytes in 16-byte
aligned pieces, nothing is planned off CUDA, and the attention layer hands its decode backend
the weight the output projection streams (a dense one; none for kbit, whose kernels are not
bound by their weight bytes)."""

from __future__ import annotations

import pytest
import torch

from quantfw.kernels.common import l2_prefetch
from quantfw.layers.attention import Attention
from quantfw.layers.linear import RowParallelLinear
from quantfw.layers.quantization.kbit import KbitConfig


@pytest.mark.parametrize("total,programs", [(23592960, 96), (16, 256), (4096 * 4096 * 2, 264)])
def test_slices_tile_the_bytes_aligned(total, programs):
    size = l2_prefetch.slice_bytes(total, programs)
    assert size % 16 == 0 and size * programs >= total and size < total / programs + 16
    starts = [p * size for p in range(programs) if p * size < total]
    ends = [min(total, s + size) for s in starts]
    assert starts[0] == 0 and ends[-1] == total
    assert all(a == b for a, b in zip(ends[:-1], starts[1:], strict=False))


def test_nothing_is_planned_off_cuda():
    assert l2_prefetch.plan(torch.empty(4096, 4096), 96) is None
    assert l2_prefetch.plan(None, 96) is None


def test_attention_hands_over_the_dense_output_weight_only():
    attn = Attention(8, 16, 2, scale=0.25)
    assert attn.next_streamed_weight() is None
    dense = RowParallelLinear(128, 64, bias=False)
    attn.set_next_linear(dense)
    assert attn.next_streamed_weight() is dense.weight
    # a plain attribute: the linear layer stays the model's, not a submodule of attention
    assert not list(attn.children()) and "weight" not in dict(attn.named_parameters())
    kbit = RowParallelLinear(128, 64, bias=False, quant_config=KbitConfig(bits=4))
    attn.set_next_linear(kbit)
    assert attn.next_streamed_weight() is None
