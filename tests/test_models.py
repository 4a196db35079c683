"""Dense Llama / Qwen2 / Qwen3 (and Mistral-style) checkpoints load through quantfw and match
transformers' logits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import quantfw

TOL = 1e-4


def _compare(hf_model, folder, random_ids, rel_err, *, seq=37, **load_kwargs):
    model = quantfw.load_model(folder, device="cpu", **load_kwargs)
    ids = random_ids(hf_model.config.vocab_size, batch=2, seq=seq)
    with torch.no_grad():
        expected = hf_model(ids).logits
        got = model(ids)
    assert got.shape == expected.shape
    assert torch.isfinite(got).all()
    err = rel_err(got, expected)
    assert err <= TOL, f"relative error {err:.3e} > {TOL}"
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_family_matches_transformers(family, hf_checkpoint, random_ids, rel_err):
    hf_model, folder = hf_checkpoint(family)
    _compare(hf_model, folder, random_ids, rel_err)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=True),
        dict(num_key_value_heads=1),
        dict(attention_bias=True, mlp_bias=True),
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ],
    ids=[
        "tied",
        "one-kv-head",
        "biases",
        "rope-linear",
        "rope-dynamic",
        "rope-llama3",
        "rope-yarn",
    ],
)
def test_llama_variants(overrides, hf_checkpoint, random_ids, rel_err):
    hf_model, folder = hf_checkpoint("llama", rope_theta=500.0, **overrides)
    # dynamic NTK only changes frequencies past max_position_embeddings (128)
    _compare(hf_model, folder, random_ids, rel_err, seq=150 if "dynamic" in str(overrides) else 37)


def test_rope_scaling_changes_the_result(hf_checkpoint, random_ids):
    """Guards the variant tests above: a scaled rope must give other logits than the default."""
    plain, plain_dir = hf_checkpoint("llama", name="plain", rope_theta=500.0)
    _, yarn_dir = hf_checkpoint(
        "llama",
        name="yarn",
        rope_theta=500.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    )
    ids = random_ids(seq=60)
    with torch.no_grad():
        a = quantfw.load_model(plain_dir, device="cpu")(ids)
        b = quantfw.load_model(yarn_dir, device="cpu")(ids)
    assert not torch.allclose(a, b, rtol=1e-3, atol=1e-5)


def test_sharded_index_ignores_consolidated_copy(hf_checkpoint, random_ids, rel_err):
    hf_model, folder = hf_checkpoint("qwen3", save_kwargs={"max_shard_size": "100KB"})
    index = json.loads(Path(os.path.join(folder, "model.safetensors.index.json")).read_text())
    assert len(set(index["weight_map"].values())) > 1
    # A stray consolidated copy of every tensor: loaded too, it would be a duplicate.
    save_file(
        {k: v.contiguous() for k, v in hf_model.state_dict().items()},
        os.path.join(folder, "consolidated.safetensors"),
    )
    _compare(hf_model, folder, random_ids, rel_err)


def test_consolidated_copy_without_index_is_a_duplicate_error(hf_checkpoint):
    hf_model, folder = hf_checkpoint("llama")
    save_file(
        {k: v.contiguous() for k, v in hf_model.state_dict().items()},
        os.path.join(folder, "consolidated.safetensors"),
    )
    with pytest.raises(ValueError, match="a second time"):
        quantfw.load_model(folder, device="cpu")


def test_bin_fallback(hf_checkpoint, random_ids, rel_err, tmp_path):
    hf_model, folder = hf_checkpoint("qwen2")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in os.listdir(folder):
        if name.endswith(".json"):
            (bin_dir / name).write_bytes(Path(os.path.join(folder, name)).read_bytes())
    torch.save(hf_model.state_dict(), bin_dir / "pytorch_model.bin")
    torch.save({"lr": torch.tensor(1.0)}, bin_dir / "training_args.bin")  # a training leftover
    _compare(hf_model, str(bin_dir), random_ids, rel_err)
    _compare(hf_model, str(bin_dir), random_ids, rel_err, load_format="pt")
    with pytest.raises(ValueError, match="no weight files"):
        quantfw.load_model(str(bin_dir), device="cpu", load_format="safetensors")


def test_dtype_override_and_auto(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    assert quantfw.load_model(folder, device="cpu").lm_head.weight.dtype == torch.float32
    model = quantfw.load_model(folder, device="cpu", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_dummy_loader_is_deterministic_and_finite(hf_checkpoint, random_ids):
    _, folder = hf_checkpoint("qwen3")
    a = quantfw.load_model(folder, device="cpu", load_format="dummy")
    b = quantfw.load_model(folder, device="cpu", load_format="dummy")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
        assert pa.abs().sum() > 0, f"{name} was not filled"
    ids = random_ids(seq=9)
    with torch.no_grad():
        assert torch.isfinite(a(ids)).all()


def test_hub_repo_id_from_offline_cache(hf_checkpoint, random_ids, rel_err, tmp_path, monkeypatch):
    """A repo id resolves through the HF cache layout with HF_HUB_OFFLINE=1 (no network)."""
    hf_model, folder = hf_checkpoint("llama")
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--quantfw-tests--tiny-llama"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in os.listdir(folder):
        (snapshot / name).write_bytes(Path(os.path.join(folder, name)).read_bytes())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = quantfw.load_model("quantfw-tests/tiny-llama", device="cpu", download_dir=str(cache))
    ids = random_ids(seq=11)
    with torch.no_grad():
        assert rel_err(model(ids), hf_model(ids).logits) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_matches_transformers(family, hf_checkpoint, random_ids, rel_err):
    hf_model, folder = hf_checkpoint(family)
    model = quantfw.load_model(folder, device="cuda", dtype="float32")
    ids = random_ids(hf_model.config.vocab_size, batch=2, seq=37)
    with torch.no_grad():
        expected = hf_model(ids).logits
        got = model(ids.cuda()).cpu()
    assert rel_err(got, expected) <= 1e-3
