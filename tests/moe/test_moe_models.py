"""Tiny GPT-OSS and Qwen3-MoE checkpoints (dense experts and MXFP4 exports) load through quantfw
and match transformers' logits in float32 (relative error <= 1e-4), with prompts longer than
GPT-OSS's sliding window; greedy generation through the engine is token-identical."""

from __future__ import annotations

import json
import os

import pytest
import tiny_moe
import torch

import quantfw

TOL = 1e-4
SEQ = 29  # > GPT-OSS's window of 8


def _logits_err(model, reference, rel_err, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tiny_moe.VOCAB, (2, SEQ), generator=g)
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids)
    assert got.shape == expected.shape and torch.isfinite(got).all()
    return rel_err(got, expected)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_dense_experts_match_transformers(family, moe_checkpoints, rel_err):
    from transformers import AutoModelForCausalLM

    folder = moe_checkpoints[family]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = quantfw.load_model(folder, device="cpu", dtype="float32")
    assert _logits_err(model, reference, rel_err) <= TOL


def test_gpt_oss_mxfp4_matches_transformers_loading_it(moe_checkpoints, rel_err):
    """transformers itself reads our GPT-OSS export (Mxfp4Config(dequantize=True))."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    folder = moe_checkpoints["gpt_oss_experts"]
    with open(os.path.join(folder, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "mxfp4"
    assert "model.layers.*.self_attn.q_proj" in qc["modules_to_not_convert"]
    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    model = quantfw.load_model(folder, device="cpu", dtype="float32")
    experts = model.model.layers[0].mlp.experts
    assert type(experts.quant_method).__name__ == "Mxfp4MoEMethod"
    assert type(model.model.layers[0].self_attn.qkv_proj.quant_method).__name__ == (
        "UnquantizedLinearMethod"
    )
    assert _logits_err(model, reference, rel_err) <= TOL
    # the rounding is real: the dense model differs by far more than the tolerance
    dense = quantfw.load_model(moe_checkpoints["gpt_oss"], device="cpu", dtype="float32")
    assert _logits_err(dense, reference, rel_err) > 10 * TOL


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_mxfp4_experts_and_dense_layers_match_rounded_transformers(
    family, moe_checkpoints, rel_err
):
    folder = moe_checkpoints[f"{family}_mxfp4"]
    reference = tiny_moe.rounded_reference(moe_checkpoints[family], folder)
    model = quantfw.load_model(folder, device="cpu", dtype="float32")
    methods = {type(m.quant_method).__name__ for m in model.modules() if hasattr(m, "quant_method")}
    assert {"Mxfp4MoEMethod", "Mxfp4LinearMethod"} <= methods
    assert _logits_err(model, reference, rel_err) <= TOL


PROMPTS = [
    [1, 17, 45, 102, 7, 66, 250, 31, 9, 4, 77, 150, 12],  # 13 tokens > the window of 8
    [1, 5],
    [1, 88, 23, 61, 199, 14, 3, 42, 8, 120, 36, 91, 55, 240, 18, 7, 29],
]
MAX_NEW = 12


@pytest.mark.parametrize("name", ["gpt_oss_experts", "qwen3_moe_mxfp4"])
def test_engine_greedy_matches_transformers(name, moe_checkpoints):
    from quantfw.engine import LLM, SamplingParams

    folder = moe_checkpoints[name]
    family = name.split("_mxfp4")[0].removesuffix("_experts")
    reference = tiny_moe.rounded_reference(moe_checkpoints[family], folder)
    expected = tiny_moe.hf_greedy(reference, PROMPTS, MAX_NEW)
    # a block size below the window, chunked prefill: sliding layers drop old blocks mid-prompt
    llm = LLM(
        folder,
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=8,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_gpu_matches_transformers(dtype, tol, moe_checkpoints, rel_err):
    """The Triton grouped GEMMs (MXFP4 experts and dense layers) inside the model on CUDA."""
    folder = moe_checkpoints["gpt_oss_mxfp4"]
    reference = tiny_moe.rounded_reference(moe_checkpoints["gpt_oss"], folder)
    model = quantfw.load_model(folder, device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny_moe.VOCAB, (2, SEQ), generator=g)
    with torch.no_grad():
        got = model(ids.cuda()).float().cpu()
        expected = reference(ids).logits
    assert rel_err(got, expected) <= tol


@pytest.mark.gpu
def test_gpu_engine_with_cuda_graphs_matches_transformers(moe_checkpoints):
    from quantfw.engine import LLM, SamplingParams

    folder = moe_checkpoints["gpt_oss_experts"]
    reference = tiny_moe.rounded_reference(moe_checkpoints["gpt_oss"], folder)
    llm = LLM(folder, device="cuda", dtype="float32", block_size=4, cuda_graphs=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == tiny_moe.hf_greedy(reference, PROMPTS, MAX_NEW)
