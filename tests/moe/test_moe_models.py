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


#: bf16 logits (and each layer's router logits) against the fp32 reference routed the same way;
#: on CPU over seeds 0-3, ours are 0.030-0.040 off and transformers' own bf16 model 0.030-0.044
BF16_TOL = 6e-2
#: how far below the fp32 reference's k-th router logit an expert the bf16 model chose instead
#: may lie, relative to the layer's largest |logit|: at most twice the router logits' own bf16
#: error (0.010-0.024 on CPU) for a near-tie flip; a wrong choice lies ~0.1-1 below
TIE_TOL = 5e-2


def _routed_bf16_check(
    device: str, moe_checkpoints, rel_err, seed: int = 0, quantization_args=None
) -> None:
    """quantfw's bfloat16 GPT-OSS on `device` against transformers' float32 model with the same
    (MXFP4-rounded) weights, routed like the model under test.

    A router near-tie (two experts' logits closer than their bf16 rounding error) flips a
    token's top-k choice, which changes that token's output completely: a whole-logits
    comparison then fails without any bug (on CPU, 2-5 of the 58 tokens x 3 layers flip per
    seed, and transformers' own bf16 model flips likewise). So the reference is made to route
    every token to the experts the model chose (weights from its own fp32 logits), and each
    check can still fail for a real bug: (1) every expert the model chose lies within `TIE_TOL`
    of the reference's own top-k (a wrong choice is no near-tie); (2) each layer's router
    logits and (3) the output logits are within `BF16_TOL` (everything else)."""
    folder = moe_checkpoints["gpt_oss_mxfp4"]
    reference = tiny_moe.rounded_reference(moe_checkpoints["gpt_oss"], folder)
    model = quantfw.load_model(
        folder, device=device, dtype="bfloat16", quantization_args=quantization_args
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tiny_moe.VOCAB, (2, SEQ), generator=g)
    chosen, router_logits, unhook = tiny_moe.record_routing(model)
    with torch.no_grad():
        got = model(ids.to(device)).float().cpu()
        unhook()
        with tiny_moe.gpt_oss_routed_as(reference, chosen) as seen:
            expected = reference(ids).logits
    gap, flips = tiny_moe.near_tie_gap(seen, chosen)
    per_token = ((got - expected).abs().amax(-1) / expected.abs().max()).flatten()
    detail = f"flips (layer, token) {flips}; worst tokens {per_token.topk(3)}"
    assert gap <= TIE_TOL, f"routing gap {gap:.4f}; {detail}"
    router_errs = [rel_err(ours, ref) for ours, (ref, _) in zip(router_logits, seen, strict=True)]
    assert max(router_errs) <= BF16_TOL, f"router logits errors {router_errs}; {detail}"
    err = rel_err(got, expected)
    assert err <= BF16_TOL, f"relative error {err:.4f}; {detail}"


def test_bf16_matches_transformers_routed_alike(moe_checkpoints, rel_err):
    """The CPU twin of the bf16 GPU check (the reference kernels, the same criterion)."""
    _routed_bf16_check("cpu", moe_checkpoints, rel_err)


@pytest.mark.gpu
def test_gpu_matches_transformers(moe_checkpoints, rel_err):
    """The Triton grouped GEMMs (MXFP4 experts and dense layers) inside the model on CUDA,
    float32: the logits of transformers' float32 model."""
    folder = moe_checkpoints["gpt_oss_mxfp4"]
    reference = tiny_moe.rounded_reference(moe_checkpoints["gpt_oss"], folder)
    model = quantfw.load_model(folder, device="cuda", dtype="float32")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny_moe.VOCAB, (2, SEQ), generator=g)
    with torch.no_grad():
        got = model(ids.cuda()).float().cpu()
        expected = reference(ids).logits
    assert rel_err(got, expected) <= TOL


@pytest.mark.gpu
def test_gpu_bf16_matches_transformers_routed_alike(moe_checkpoints, rel_err):
    """bfloat16 on CUDA (see `_routed_bf16_check` for why the reference follows our routing)."""
    _routed_bf16_check("cuda", moe_checkpoints, rel_err)


@pytest.mark.gpu
def test_gpu_engine_with_cuda_graphs_matches_transformers(moe_checkpoints):
    from quantfw.engine import LLM, SamplingParams

    folder = moe_checkpoints["gpt_oss_experts"]
    reference = tiny_moe.rounded_reference(moe_checkpoints["gpt_oss"], folder)
    llm = LLM(folder, device="cuda", dtype="float32", block_size=4, cuda_graphs=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == tiny_moe.hf_greedy(reference, PROMPTS, MAX_NEW)


@pytest.mark.gpu
def test_gpu_gpt_oss_decode_projection_rotates_and_stores(moe_checkpoints, monkeypatch):
    """GPT-OSS (MXFP4 experts) in bfloat16 decoding one sequence past its sliding window under
    CUDA graphs: the q/k/v projections' rotary epilogue (YaRN cos/sin, k and v straight to the
    cache of both layer kinds) gives the tokens of the separate rotary-and-store kernel."""
    from rope_store import watch_rope_store

    from quantfw.engine import LLM, SamplingParams

    tokens, served = {}, {}
    for fused in (True, False):
        served[fused] = watch_rope_store(monkeypatch, fused)
        folder = moe_checkpoints["gpt_oss_experts"]
        llm = LLM(folder, device="cuda", dtype="bfloat16", block_size=4, max_num_seqs=1,
                  cuda_graphs=True)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        tokens[fused] = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
        del llm
    assert any(served[True])
    assert tokens[True] == tokens[False]


FLASHINFER = {"moe_backend": "flashinfer"}


def test_flashinfer_backend_off_its_gpus_is_a_clear_error(moe_checkpoints):
    with pytest.raises(ValueError, match=r"experts: mxfp4 moe_backend='flashinfer' needs"):
        quantfw.load_model(
            moe_checkpoints["gpt_oss_mxfp4"], device="cpu", quantization_args=FLASHINFER
        )
    with pytest.raises(ValueError, match="moe_backend='cutlass'; supported: auto, triton"):
        quantfw.load_model(
            moe_checkpoints["gpt_oss_mxfp4"],
            device="cpu",
            quantization_args={"moe_backend": "cutlass"},
        )


@pytest.mark.gpu
def test_gpu_flashinfer_experts_match_transformers_routed_alike(moe_checkpoints, rel_err):
    """The tiny GPT-OSS (hidden and intermediate sizes padded to 128) with its MXFP4 experts in
    FlashInfer's SM90 fused MoE, bfloat16 (see `_routed_bf16_check`)."""
    tiny_moe.require_sm90_flashinfer()
    _routed_bf16_check("cuda", moe_checkpoints, rel_err, quantization_args=FLASHINFER)


@pytest.mark.gpu
def test_gpu_flashinfer_experts_under_cuda_graphs(moe_checkpoints):
    """The engine captures FlashInfer's fused MoE in its decode graphs: greedy tokens with
    graphs equal those without."""
    from quantfw.engine import LLM, SamplingParams

    tiny_moe.require_sm90_flashinfer()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(
            moe_checkpoints["gpt_oss_mxfp4"], device="cuda", dtype="bfloat16", block_size=4,
            cuda_graphs=graphs, quantization_args=FLASHINFER,
        )  # fmt: skip
        outs[graphs] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        del llm
    assert outs[True] == outs[False]
