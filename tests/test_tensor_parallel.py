"""Two gloo ranks under torchrun give the TP=1 logits, including a GQA config with one kv head
(replicated on both ranks); heads not divisible by the TP size is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from config_only import config_folder

import quantfw

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "tp_logits.py")


def run_torchrun(out_dir, folders, nproc=2, extra_args=()):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        SCRIPT,
        str(out_dir),
        *folders,
        *extra_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(os.path.join(out_dir, f"{i}.pt")) for i in range(len(folders))]


@pytest.mark.slow
def test_tp2_equals_tp1(hf_checkpoint, rel_err, tmp_path):
    cases = [
        hf_checkpoint("llama", name="llama", save_kwargs={"max_shard_size": "100KB"}),
        hf_checkpoint("qwen2", name="qwen2"),
        hf_checkpoint("qwen3", name="qwen3", tie_word_embeddings=True),
        hf_checkpoint("llama", name="one_kv", num_key_value_heads=1),
        hf_checkpoint(
            "llama",
            name="three_heads",
            hidden_size=48,
            num_attention_heads=3,
            num_key_value_heads=3,
        ),
    ]
    out = tmp_path / "out"
    out.mkdir()
    results = run_torchrun(out, [folder for _, folder in cases])
    for (hf_model, folder), result in zip(cases[:-1], results[:-1]):
        assert "error" not in result, result.get("error")
        tp1 = quantfw.load_model(folder, device="cpu")
        with torch.no_grad():
            expected = tp1(result["ids"])
            assert rel_err(expected, hf_model(result["ids"]).logits) <= 1e-4
        err = rel_err(result["logits"], expected)
        assert err <= 1e-5, f"{folder}: TP=2 vs TP=1 relative error {err:.2e}"
    assert (
        "number of attention heads 3 is not divisible by tensor_parallel_size 2"
        in results[-1]["error"]
    )


@pytest.mark.slow
def test_tp2_engine_generates_the_tp1_tokens(hf_checkpoint, tmp_path):
    """The per-step tensor protocol (header + packed payload) keeps both ranks in lockstep
    through chunked prefill and preemption."""
    from quantfw.engine import LLM, SamplingParams

    _, folder = hf_checkpoint("qwen3", name="qwen3_tp")
    script = os.path.join(os.path.dirname(__file__), "scripts", "tp_generate.py")
    out = tmp_path / "tokens.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, script, str(out), folder], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = torch.load(out)
    assert result["preemptions"] > 0
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=48, block_size=4)
    prompts = [list(range(1, 4 + 5 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == result["tokens"]


@pytest.mark.slow
def test_tp2_dummy_model_equals_tp1(rel_err, tmp_path):
    """Dummy weights are one full tensor per parameter, sharded like a checkpoint: the TP=2 model
    computes the TP=1 function (kv head replicated, vocab padded differently, packed and grouped
    quantized tensors, act-order)."""
    names = ["dense", "awq", "gptq_v1_asym", "gptq_v1_act"]
    folders = [config_folder(tmp_path / name, name) for name in names]
    out = tmp_path / "out"
    out.mkdir()
    results = run_torchrun(out, folders, extra_args=["--load-format", "dummy"])
    for name, folder, result in zip(names, folders, results):
        assert "error" not in result, result.get("error")
        tp1 = quantfw.load_model(folder, device="cpu", load_format="dummy")
        with torch.no_grad():
            expected = tp1(result["ids"])
        err = rel_err(result["logits"], expected)
        assert err <= 1e-5, f"{name}: TP=2 vs TP=1 relative error {err:.2e}"


def test_teardown_hooks_run_before_the_process_group_goes(monkeypatch):
    """`destroy_distributed` calls the `on_teardown` hooks of owners still alive (an engine
    dropping its decode graphs) before it destroys the group, once; collected owners are
    skipped."""
    from quantfw import distributed as qdist

    events = []

    class Owner:
        def __init__(self, name):
            self.name = name

        def release(self):
            events.append(self.name)

        def fail(self):
            raise RuntimeError("a hook failed")

    monkeypatch.setattr(qdist, "_teardown_hooks", [])
    kept, dropped = Owner("kept"), Owner("dropped")
    qdist.on_teardown(kept.release)
    qdist.on_teardown(dropped.release)
    del dropped
    monkeypatch.setattr(qdist.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(qdist.dist, "destroy_process_group", lambda: events.append("destroy"))
    qdist.destroy_distributed()
    assert events == ["kept", "destroy"]
    qdist.destroy_distributed()  # the hooks ran once
    assert events == ["kept", "destroy", "destroy"]
    qdist.on_teardown(kept.fail)
    with pytest.raises(RuntimeError, match="a hook failed"):
        qdist.destroy_distributed()
    assert events[-1] == "destroy"  # the group went all the same
