"""RMSNorm rounds as transformers does in bf16: Llama rounds the normalized input before the
weight, GPT-OSS scales by the weight in float32 and rounds once (the two differ by an ulp)."""

from __future__ import annotations

import pytest
import torch

from quantfw.layers.norm import RMSNorm
from quantfw.models.gpt_oss import GptOssForCausalLM
from quantfw.models.llama import LlamaForCausalLM


def _hf_norm(weight_in_float32: bool, hidden: int, eps: float) -> torch.nn.Module:
    if weight_in_float32:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm as HFNorm
    else:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFNorm
    return HFNorm(hidden, eps=eps)


@pytest.mark.parametrize("weight_in_float32", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_rounds_like_transformers(weight_in_float32, dtype):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(64, 96, generator=g)).to(dtype)
    residual = torch.randn(64, 96, generator=g).to(dtype)
    weight = (0.5 + torch.rand(96, generator=g)).to(dtype)
    ours = RMSNorm(96, 1e-5, params_dtype=dtype, weight_in_float32=weight_in_float32)
    theirs = _hf_norm(weight_in_float32, 96, 1e-5).to(dtype)
    other = RMSNorm(96, 1e-5, params_dtype=dtype, weight_in_float32=not weight_in_float32)
    with torch.no_grad():
        for norm in (ours, theirs, other):
            norm.weight.copy_(weight)
        expected = theirs(x)
        assert torch.equal(ours(x), expected)
        out, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(out, theirs(x + residual))
        assert not torch.equal(other(x), expected)  # the rounding order is visible


def test_gpt_oss_norms_scale_in_float32():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt_oss", hidden_size=64)
    assert GptOssForCausalLM.build_norm(config).weight_in_float32
    assert not LlamaForCausalLM.build_norm(config).weight_in_float32
