"""TP=2 under torchrun (gloo on the CPU, NCCL on two GPUs) gives the TP=1 logits and greedy
tokens for the MoE models: the experts' intermediate dim sharded with padding (I = 96 is three
32-blocks: rank 1 holds one real block and one of zeros), one all-reduce after the combine,
sinks sharded with the heads."""

from __future__ import annotations

import pytest
import tiny_moe
import torch
from torchrun import torchrun2, tp2_logits

import quantfw
from quantfw.kernels.common import is_sm90


@pytest.mark.slow
def test_tp2_logits_and_tokens_equal_tp1(moe_checkpoints, rel_err, tmp_path):
    from quantfw.engine import LLM, SamplingParams

    names = ["gpt_oss_mxfp4", "gpt_oss_experts", "qwen3_moe", "qwen3_moe_mxfp4"]
    folders = [moe_checkpoints[n] for n in names]
    torchrun2("tp_logits.py", str(tmp_path), *folders)
    tokens_out = tmp_path / "tokens.pt"
    torchrun2("tp_generate.py", str(tokens_out), moe_checkpoints["gpt_oss_experts"])
    for i, (name, folder) in enumerate(zip(names, folders)):
        result = torch.load(tmp_path / f"{i}.pt")
        assert "error" not in result, f"{name}: {result.get('error')}"
        tp1 = quantfw.load_model(folder, device="cpu", dtype="float32")
        with torch.no_grad():
            expected = tp1(result["ids"])
        err = rel_err(result["logits"], expected)
        assert err <= 1e-5, f"{name}: TP=2 vs TP=1 relative error {err:.2e}"
    reference = tiny_moe.rounded_reference(
        moe_checkpoints["gpt_oss"], moe_checkpoints["gpt_oss_experts"]
    )
    prompts = [list(range(1, 4 + 5 * i)) for i in range(4)]  # as tp_generate.py; up to 19 > 8
    assert torch.load(tokens_out)["tokens"] == tiny_moe.hf_greedy(reference, prompts, 14)
    llm = LLM(moe_checkpoints["gpt_oss_experts"], device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == torch.load(
        tokens_out
    )["tokens"]


def _logits_and_untied_rows(model, ids: torch.Tensor, margin: float = 5e-3):
    """TP = 1's float32 logits ``[B S, V]`` and a mask of the rows to compare: a token whose k-th
    and (k+1)-th router logits of some MoE layer are within ``margin`` may be routed
    differently at TP = 1 and 2 after fp16 rounding, and attention carries that to the later
    tokens of its sequence, so a sequence's rows from its first such token on are left out."""
    from quantfw.layers.moe.layer import FusedMoE

    gaps = []

    def hook(module, args):
        top = args[1].reshape(-1, module.num_experts).float().topk(module.top_k + 1).values
        gaps.append((top[:, -2] - top[:, -1]).cpu())

    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    handles = [m.register_forward_pre_hook(hook) for m in moes]
    with torch.no_grad():
        logits = model(ids.cuda()).float().cpu()
    for h in handles:
        h.remove()
    tied = (torch.stack(gaps).amin(0) < margin).reshape(ids.shape)
    return logits.reshape(ids.numel(), -1), (tied.int().cumsum(1) == 0).flatten()


#: per activation dtype: the models, the router-logit gap under which a routing decision
#: counts as tied (bf16 rounds 8x coarser than fp16), the relative error allowed
_GPU_TP_CASES = {
    "float16": (["gpt_oss_mxfp4", "gpt_oss_experts", "qwen3_moe", "qwen3_moe_mxfp4"], 5e-3, 1e-2),
    "bfloat16": (["gpt_oss_mxfp4", "qwen3_moe_mxfp4"], 2e-2, 3e-2),
}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("dtype", list(_GPU_TP_CASES))
def test_tp2_on_two_gpus_equals_tp1(moe_checkpoints, rel_err, tmp_path, dtype):
    """The GPU MoE paths on padded intermediate shards at TP = 2 through NCCL give TP = 1's
    logits on every row not downstream of a near-tied routing decision (at least a quarter):
    in fp16 the lookup mma kernel at decode and the Triton / dequantize paths for more rows;
    in bf16 on sm_90 the MXFP4 models' 256-token batch runs the wgmma kernel (64 and 85 rows
    per expert)."""
    from quantfw.kernels.mxfp4.triton import grouped_gemm

    names, margin, tol = _GPU_TP_CASES[dtype]
    if dtype == "bfloat16" and is_sm90(torch.device("cuda")):
        for experts in (6, 8):  # the tiny GPT-OSS's and Qwen3-MoE's: 256 tokens x top 2
            assert grouped_gemm.default_config(512, experts, 64, 64, hopper=True).get("WGMMA")
    _tp2_equals_tp1(
        moe_checkpoints, rel_err, tmp_path, names, margin, tol, {"device": "cuda", "dtype": dtype}
    )


def _one_sequence_runs(moe_checkpoints, tmp_path, modes) -> dict[str, dict]:
    """`tp_generate.py`'s one-sequence GPU run of GPT-OSS (MXFP4 experts) at TP = 2 in each
    mode: rank 0's tokens and counts."""
    runs = {}
    for mode in modes:
        out = tmp_path / f"{mode}.pt"
        torchrun2(
            "tp_generate.py", str(out), moe_checkpoints["gpt_oss_experts"], "one-sequence-gpu", mode
        )
        runs[mode] = torch.load(out)
    return runs


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_decode_projection_rotates_and_stores_on_each_rank(moe_checkpoints, tmp_path):
    """GPT-OSS (MXFP4 experts, bfloat16) at TP = 2 decoding one sequence under CUDA graphs:
    each rank's q/k/v projection rotates its own heads and stores its own key and value
    (`kernels.dense.ops.linear_rope_store`), and the tokens are those of the separate
    rotary-and-store kernel at TP = 2."""
    runs = _one_sequence_runs(moe_checkpoints, tmp_path, ("fused", "unfused"))
    assert runs["fused"]["served"] > 0
    assert runs["fused"]["tokens"] == runs["unfused"]["tokens"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_prefill_graph_matches_eager_prefill(moe_checkpoints, tmp_path):
    """GPT-OSS (MXFP4 experts, bfloat16) at TP = 2: the 13-token prefill replayed as a CUDA
    graph on both ranks (its all-reduces captured) gives the tokens of the eager prefill."""
    runs = _one_sequence_runs(moe_checkpoints, tmp_path, ("fused", "eager-prefill"))
    assert runs["fused"]["prefill_graphs"] == [13]
    assert runs["eager-prefill"]["prefill_graphs"] == []
    assert runs["fused"]["tokens"] == runs["eager-prefill"]["tokens"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_flashinfer_experts_on_two_gpus_equal_tp1(moe_checkpoints, rel_err, tmp_path):
    """FlashInfer's SM90 fused MoE (bf16) on each rank's padded intermediate shard."""
    tiny_moe.require_sm90_flashinfer()
    names, margin, tol = _GPU_TP_CASES["bfloat16"]
    gpu = {
        "device": "cuda",
        "dtype": "bfloat16",
        "quantization_args": {"moe_backend": "flashinfer"},
    }
    _tp2_equals_tp1(moe_checkpoints, rel_err, tmp_path, names, margin, tol, gpu)


def _tp2_equals_tp1(moe_checkpoints, rel_err, tmp_path, names, margin, tol, gpu) -> None:
    """Each of `names` loaded with `gpu` (load_model's arguments) at TP = 2 gives TP = 1's
    logits on the rows no near-tied routing decision feeds (at least a quarter of them)."""
    gen = torch.Generator().manual_seed(99)
    batches = [
        torch.randint(0, tiny_moe.VOCAB, shape, generator=gen)
        for shape in ((1, 2), (2, 23), (4, 64))
    ]
    dtype = gpu["dtype"]
    results = tp2_logits([[moe_checkpoints[n], gpu] for n in names], batches, tmp_path)
    for name, result in zip(names, results):
        assert "error" not in result, f"{name}: {result.get('error')}"
        model = quantfw.load_model(moe_checkpoints[name], **gpu)
        for batch, got in zip(batches, result["logits"]):
            want, rows = _logits_and_untied_rows(model, batch, margin)
            where = f"{name} {dtype} {list(batch.shape)}"
            assert rows.float().mean() >= 0.25, f"{where}: only {int(rows.sum())} rows untied"
            err = rel_err(got.reshape(batch.numel(), -1)[rows], want[rows])
            assert err <= tol, f"{where}: TP=2 vs TP=1 relative error {err:.2e}"
