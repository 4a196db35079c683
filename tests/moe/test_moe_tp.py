"""TP=2 under torchrun (gloo, CPU) gives the TP=1 logits and greedy tokens for the MoE models:
the experts' intermediate dim sharded with padding (I = 96 is three 32-blocks: rank 1 holds one
real block and one of zeros), one all-reduce after the combine, sinks sharded with the heads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tiny_moe
import torch

import quantfw

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def _torchrun(script: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, os.path.join(SCRIPTS, script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_tp2_logits_and_tokens_equal_tp1(moe_checkpoints, rel_err, tmp_path):
    from quantfw.engine import LLM, SamplingParams

    names = ["gpt_oss_mxfp4", "gpt_oss_experts", "qwen3_moe", "qwen3_moe_mxfp4"]
    folders = [moe_checkpoints[n] for n in names]
    _torchrun("tp_logits.py", str(tmp_path), *folders)
    tokens_out = tmp_path / "tokens.pt"
    _torchrun("tp_generate.py", str(tokens_out), moe_checkpoints["gpt_oss_experts"])
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
