"""kbit models: tiny Llama / Qwen3 exported with ``quantfw quantize --method kbit`` and dense
checkpoints quantized while loading match transformers with the dequantized weights, at TP=1
and TP=2 (torchrun, gloo); bad configs, checkpoints and shards fail with clear errors; the
dummy loader builds a valid random kbit model."""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoint_edit import edited_copy
from torchrun import tp2_logits

import quantfw
from quantfw.kernels.kbit import format as kfmt
from quantfw.layers.quantization.kbit import KbitConfig, KbitLinearMethod
from quantfw.models.utils import WeightLoadError

TOL = 1e-4
SKEWED_2BIT = [-1.0, -0.3, 0.2, 0.9]


def _kbit_layers(model):
    return [
        m for m in model.modules() if isinstance(m.__dict__.get("quant_method"), KbitLinearMethod)
    ]


def _check(model, hf, seed, head=False):
    ids = torch.randint(
        0, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        got, want = model(ids), hf(ids).logits
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert err <= TOL, f"relative error {err:.3e}"
    layers = _kbit_layers(model)
    assert len(layers) == 4 * hf.config.num_hidden_layers + head
    assert (model.lm_head in layers) == head
    for layer in layers:
        assert {n for n, _ in layer.named_buffers()} == {
            "kbit_qweight",
            "kbit_scales",
            "kbit_codebook",
        }
        assert [n for n, _ in layer.named_parameters()] in ([], ["bias"])


@pytest.mark.parametrize(
    "family,bits", [("llama", 2), ("llama", 3), ("llama", 4), ("llama", 5), ("qwen3", 4)]
)
def test_exported_checkpoint_matches_dequantized_transformers(
    family, bits, exported, dense_dir, quant_ref
):
    folder = exported(family, f"kbit{bits}")
    with open(os.path.join(folder, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "kbit" and qc["bits"] == bits and qc["blocksize"] == 32
    model = quantfw.load_model(folder, dtype="float32", device="cpu")
    _check(model, quant_ref.model(dense_dir(family), folder), seed=bits)


@pytest.mark.parametrize("family,bits", [("llama", 3), ("qwen3", 2), ("qwen3", 5)])
def test_dense_checkpoint_quantized_while_loading(family, bits, dense_dir, quant_ref):
    model = quantfw.load_model(
        dense_dir(family), dtype="float32", device="cpu", quantization="kbit",
        quantization_args={"bits": bits},
    )  # fmt: skip
    assert "quantized while loading" in repr(
        model.model.layers[0].mlp.down_proj.quant_method.config
    )
    _check(model, quant_ref.kbit_model(dense_dir(family), bits), seed=10 + bits)


def test_custom_codebook_while_loading(dense_dir, quant_ref):
    args = {"bits": 2, "codebook": SKEWED_2BIT}
    model = quantfw.load_model(
        dense_dir("llama"),
        dtype="float32",
        device="cpu",
        quantization="kbit",
        quantization_args=args,
    )
    _check(model, quant_ref.kbit_model(dense_dir("llama"), 2, SKEWED_2BIT), seed=5)
    assert model.model.layers[1].self_attn.qkv_proj.kbit_codebook.tolist() == pytest.approx(
        SKEWED_2BIT
    )


def test_no_dense_weight_is_ever_allocated(dense_dir):
    """The model quantized while loading is built with quantized-size parameters: every linear
    holds at most bits/8 + 1/32 bytes per weight from construction on."""
    from quantfw.config import ModelConfig
    from quantfw.loaders.base import initialize_model

    mc = ModelConfig(
        dense_dir("qwen3"), dtype="float32", quantization="kbit", quantization_args={"bits": 3}
    )
    model = initialize_model(mc, "meta")
    for layer in _kbit_layers(model):
        held = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
        dense = layer.input_size * layer.output_size_per_partition
        assert held <= dense * (3 / 8 + 1 / 32) + 4 * 8 + 4 * layer.output_size_per_partition
        assert layer.weight.dtype == torch.int32 and layer.weight.shape[-1] == 3


@pytest.mark.parametrize("quantized", [False, True])
def test_dummy_load_builds_a_valid_model(quantized, dense_dir, exported):
    folder = exported("llama", "kbit4") if quantized else dense_dir("llama")
    args = {} if quantized else {"quantization": "kbit", "quantization_args": {"bits": 4}}
    model = quantfw.load_model(folder, dtype="float32", device="cpu", load_format="dummy", **args)
    layers = _kbit_layers(model)
    assert len(layers) == 8
    for layer in layers:
        scales = kfmt.decode_e4m4(layer.kbit_scales)
        assert 0 < float(scales.max()) < 0.01
        assert torch.equal(layer.kbit_codebook, kfmt.normal_float_codebook(4))
    with torch.no_grad():
        logits = model(torch.randint(0, 320, (1, 7)))
    assert bool(torch.isfinite(logits).all())


# ---------------------------------------------------------------------------------------------
# the LM head quantized too (``lm_head: true``)


def test_exported_lm_head_matches_dequantized_transformers(exported, dense_dir, quant_ref):
    from safetensors import safe_open

    folder = exported("llama", "kbit4_head")
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["quantization_config"]["lm_head"] is True
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"lm_head.kbit_planes", "lm_head.kbit_absmax", "lm_head.kbit_codebook"} <= names
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    model = quantfw.load_model(folder, dtype="float32", device="cpu")
    hf = quant_ref.model(dense_dir("llama"), folder)
    dense_head = quant_ref.kbit_model(dense_dir("llama"), 4).lm_head.weight
    assert not torch.equal(hf.lm_head.weight, dense_head)  # the reference's head is dequantized
    _check(model, hf, seed=31, head=True)
    # the exporter's default keeps the head dense
    with open(os.path.join(exported("llama", "kbit4"), "config.json")) as f:
        assert json.load(f)["quantization_config"]["lm_head"] is False


@pytest.mark.parametrize("family,bits", [("qwen3", 2), ("llama", 5)])
def test_lm_head_quantized_while_loading(family, bits, dense_dir, quant_ref):
    model = quantfw.load_model(
        dense_dir(family), dtype="float32", device="cpu", quantization="kbit",
        quantization_args={"bits": bits, "lm_head": True},
    )  # fmt: skip
    assert "lm_head" in repr(model.lm_head.quant_method.config)
    _check(model, quant_ref.kbit_model(dense_dir(family), bits, lm_head=True), seed=bits, head=True)


def test_lm_head_in_modules_to_not_convert_stays_dense(dense_dir, quant_ref):
    args = {"bits": 4, "lm_head": True, "modules_to_not_convert": ["lm_head"]}
    model = quantfw.load_model(
        dense_dir("llama"), dtype="float32", device="cpu", quantization="kbit",
        quantization_args=args,
    )  # fmt: skip
    assert type(model.lm_head.quant_method).__name__ == "UnquantizedLinearMethod"
    _check(model, quant_ref.kbit_model(dense_dir("llama"), 4), seed=6)


def test_lm_head_dummy_load_and_bytes_read(dense_dir):
    from quantfw.bench.measure import weight_bytes

    args = {"quantization": "kbit", "quantization_args": {"bits": 2, "lm_head": True}}
    model = quantfw.load_model(dense_dir("llama"), device="cpu", load_format="dummy", **args)
    head = model.lm_head
    assert {n for n, _ in head.named_buffers()} == {"kbit_qweight", "kbit_scales", "kbit_codebook"}
    assert 0 < float(kfmt.decode_e4m4(head.kbit_scales).max()) < 0.01
    with torch.no_grad():
        logits = model(torch.randint(0, 320, (1, 7)))
    assert logits.shape == (1, 7, 320) and bool(torch.isfinite(logits).all())
    # a decode step reads every weight but the embedding table, the quantized head included
    held, read = weight_bytes(model)
    embedding = model.model.embed_tokens.weight
    assert read == held - embedding.numel() * embedding.element_size()
    head_bytes = sum(b.numel() * b.element_size() for b in head.buffers())
    dense = quantfw.load_model(dense_dir("llama"), device="cpu", load_format="dummy").lm_head
    model.lm_head = dense
    dense_bytes = dense.weight.numel() * dense.weight.element_size()
    assert read - weight_bytes(model)[1] == head_bytes - dense_bytes < 0


def test_lm_head_of_a_tied_model_is_an_error(dense_dir, tmp_path):
    import shutil

    from quantfw.exporter import quantize_checkpoint

    folder = tmp_path / "tied"
    shutil.copytree(dense_dir("llama"), folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    with open(folder / "config.json", "w") as f:
        json.dump({**config, "tie_word_embeddings": True}, f)
    with pytest.raises(
        ValueError, match=r"layer lm_head: KbitLinearMethod would quantize the LM head, but it is "
        r"tied to the input embedding"
    ):  # fmt: skip
        quantfw.load_model(
            str(folder), device="cpu", quantization="kbit",
            quantization_args={"bits": 4, "lm_head": True},
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"kbit export: lm_head=True, but the model ties lm_head"):
        quantize_checkpoint(str(folder), str(tmp_path / "out"), method="kbit", lm_head=True)
    # without lm_head the tied model loads as before
    model = quantfw.load_model(
        str(folder), device="cpu", quantization="kbit", quantization_args={"bits": 4}
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.slow
def test_tensor_parallel_2_matches_dequantized_transformers(
    exported, dense_dir, quant_ref, tmp_path
):
    cases = [
        (exported("llama", "kbit4"), {}, lambda: quant_ref.model(dense_dir("llama"), exported("llama", "kbit4"))),
        (exported("qwen3", "kbit2"), {}, lambda: quant_ref.model(dense_dir("qwen3"), exported("qwen3", "kbit2"))),
        (exported("llama", "kbit4_head"), {}, lambda: quant_ref.model(dense_dir("llama"), exported("llama", "kbit4_head"))),
        (dense_dir("llama"), {"quantization": "kbit", "quantization_args": {"bits": 3}},
         lambda: quant_ref.kbit_model(dense_dir("llama"), 3)),
        (dense_dir("qwen3"), {"quantization": "kbit", "quantization_args": {"bits": 5}},
         lambda: quant_ref.kbit_model(dense_dir("qwen3"), 5)),
    ]  # fmt: skip
    ids = quant_ref.ids(320, seed=21, seq=9)
    results = tp2_logits([[f, kw] for f, kw, _ in cases], [ids], tmp_path)
    for (folder, kwargs, reference), result in zip(cases, results):
        assert "error" not in result, result.get("error")
        with torch.no_grad():
            want = reference()(ids).logits
        err = quant_ref.error(result["logits"][0], want)
        assert err <= TOL, f"{folder} {kwargs}: TP=2 relative error {err:.3e}"


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "args,match",
    [
        ({"bits": 6}, r"kbit: bits=6 is not supported; supported: \[2, 3, 4, 5\]"),
        ({"bits": 1}, r"bits=1 is not supported"),
        ({}, r"kbit: bits is required"),
        ({"bits": 4, "blocksize": 64}, r"blocksize=64 is not supported; supported: \[32\]"),
        ({"bits": 2, "codebook": [-1.0, 0.0, 1.0]}, r"a 2-bit codebook has shape \[4\], got \[3\]"),
        ({"bits": 2, "codebook": [-1.0, 0.5, 0.0, 1.0]}, r"strictly ascending"),
        ({"bits": 2, "codebook": "nf"}, r"codebook='nf' is not supported"),
        ({"bits": 4, "absmax_format": "fp16"}, r"absmax_format='fp16' is not supported"),
        ({"bits": 4, "lm_head": "yes"}, r"kbit: lm_head='yes' is not supported; use true or false"),
    ],
)
def test_bad_config(args, match, dense_dir):
    with pytest.raises(ValueError, match=match):
        quantfw.load_model(
            dense_dir("llama"), device="cpu", quantization="kbit", quantization_args=args
        )


def _set(key, fn):
    def edit(state):
        state[key] = fn(state[key])

    return edit


PREFIX = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize(
    "config,edit,error,match",
    [
        # 4-bit planes read as 3-bit: [256, 16, 3] expected
        ({"bits": 3}, None, WeightLoadError,
         r"down_proj\.kbit_\w+'.*(expected \(256, 16, 3\)|\(16,\) != parameter shape \(8,\))"),
        (None, _set(f"{PREFIX}.kbit_planes", lambda t: t[:, :8].contiguous()), WeightLoadError,
         r"layers\.0\.mlp\.down_proj\.kbit_planes' -> parameter .*checkpoint shape \(256, 8, 4\)"),
        (None, _set(f"{PREFIX}.kbit_absmax", lambda t: t.to(torch.int32)), WeightLoadError,
         r"down_proj\.kbit_absmax' .*kbit_absmax must be torch\.uint8, got torch\.int32"),
        (None, _set(f"{PREFIX}.kbit_codebook", lambda t: t[:8].contiguous()), WeightLoadError,
         r"down_proj\.kbit_codebook'.*checkpoint shape \(8,\) != parameter shape \(16,\)"),
        (None, _set(f"{PREFIX}.kbit_codebook", lambda t: t.flip(0).contiguous()), ValueError,
         r"layer model\.layers\.0\.mlp\.down_proj: kbit_codebook: codebook must be strictly"),
        (None, _set("model.layers.0.self_attn.k_proj.kbit_codebook", lambda t: t * 0.5), WeightLoadError,
         r"qkv_proj\.kbit_codebook.*fused part '[qkv]' carries a different value"),
    ],
)  # fmt: skip
def test_bad_checkpoint(config, edit, error, match, exported, tmp_path):
    folder = edited_copy(exported("llama", "kbit4"), tmp_path / "bad", config=config, tensors=edit)
    with pytest.raises(error, match=match):
        quantfw.load_model(folder, dtype="float32", device="cpu")


def test_uint32_planes_load_like_int32(exported, tmp_path, quant_ref):
    def as_uint32(state):
        for key in [k for k in state if k.endswith(".kbit_planes")]:
            state[key] = state[key].view(torch.uint32)

    folder = edited_copy(exported("llama", "kbit3"), tmp_path / "u32", tensors=as_uint32)
    ids = quant_ref.ids(320, seed=4)
    with torch.no_grad():
        a = quantfw.load_model(folder, dtype="float32", device="cpu")(ids)
        b = quantfw.load_model(exported("llama", "kbit3"), dtype="float32", device="cpu")(ids)
    assert torch.equal(a, b)


class _FakeShard(torch.nn.Module):
    """What create_weights reads off a layer on TP rank 1 of 2."""

    prefix = "model.layers.0.mlp.down_proj"
    tp_rank, tp_size = 1, 2


def test_tp_shard_that_splits_a_block_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"layer model\.layers\.0\.mlp\.down_proj: input size per partition 48 "
        r"\(tensor_parallel_size 2\) is not a multiple of 32: kbit quantizes blocks of 32",
    ):
        KbitLinearMethod(KbitConfig(bits=4)).create_weights(
            _FakeShard(), 48, [64], 96, 64, torch.float32, weight_loader=lambda *a: None
        )


def test_dense_tensor_of_the_wrong_shape_is_an_error(dense_dir, tmp_path):
    folder = edited_copy(
        dense_dir("llama"),
        tmp_path / "dense",
        tensors=_set(f"{PREFIX}.weight", lambda t: t[:, :256].contiguous()),
    )
    with pytest.raises(
        WeightLoadError,
        match=r"layer model\.layers\.0\.mlp\.down_proj: a dense weight \[out, 512\]",
    ):
        quantfw.load_model(folder, device="cpu", quantization="kbit", quantization_args={"bits": 4})


def test_cli_export_options(dense_dir, tmp_path):
    from quantfw.entrypoints.cli import main

    argv = ["quantize", dense_dir("llama"), "--method", "kbit", "--bits", "2"]
    assert main([*argv, "--out", str(tmp_path / "k2")]) == 0
    with open(tmp_path / "k2" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "blocksize", "codebook")} == {
        "quant_method": "kbit", "bits": 2, "blocksize": 32, "codebook": "normal_float",
    }  # fmt: skip
    assert qc["lm_head"] is False
    assert main([*argv, "--lm-head", "--out", str(tmp_path / "head")]) == 0
    with open(tmp_path / "head" / "config.json") as f:
        assert json.load(f)["quantization_config"]["lm_head"] is True
    assert main([*argv, "--blocksize", "64", "--out", str(tmp_path / "x")]) == 1
    assert main([*argv, "--group-size", "64", "--out", str(tmp_path / "y")]) == 1


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2), (torch.float32, 1e-5)]
)
def test_cuda_layers_match_reference(dtype, tol, exported, dense_dir, quant_ref):
    """Every kbit linear on CUDA (Triton kernels for fp16/bf16, dequantize + matmul for fp32)
    against the fp64 product with the reference weights; quantizing while loading on the GPU
    gives the same packed tensors as on the CPU."""
    from quantfw.layers.linear import LinearBase

    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    folder = exported("llama", "kbit3")
    model = quantfw.load_model(folder, dtype=dtype, device="cuda")
    weights = quant_ref.weights(folder)
    checked = 0
    for prefix, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        head, _, leaf = prefix.rpartition(".")
        w = torch.cat([weights[f"{head}.{p}"] for p in fused.get(leaf, (leaf,))]).double()
        for m in (1, 7, 16, 33, 64, 300, 600):
            x = torch.randn(m, layer.input_size, dtype=dtype, device="cuda")
            out = torch.full((m, w.shape[0]), float("nan"), dtype=dtype, device="cuda")
            with torch.no_grad():
                out.copy_(layer(x))
            want = x.double().cpu() @ w.t()
            err = ((out.double().cpu() - want).norm() / want.norm()).item()
            assert err <= tol, f"{prefix} M={m} {dtype}: relative error {err:.2e}"
        checked += 1
    assert checked == 8
    args = {"quantization": "kbit", "quantization_args": {"bits": 3}}
    on_gpu = quantfw.load_model(dense_dir("llama"), dtype=dtype, device="cuda", **args)
    on_cpu = quantfw.load_model(dense_dir("llama"), dtype="float32", device="cpu", **args)
    gpu_bufs = dict(on_gpu.named_buffers())
    for name, buf in on_cpu.named_buffers():
        if name.endswith(("kbit_qweight", "kbit_scales")):
            assert torch.equal(gpu_bufs[name].cpu(), buf), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_cuda_lm_head_matches_reference(dtype, tol, exported, quant_ref):
    """The quantized LM head on CUDA (the kbit kernels at its vocabulary rows) against the fp64
    product with the reference weight, at decode and prefill sizes, every logit written."""
    folder = exported("llama", "kbit4_head")
    model = quantfw.load_model(folder, dtype=dtype, device="cuda")
    w = quant_ref.weights(folder)["lm_head"].double()
    for m in (1, 5, 16, 40, 300):
        x = torch.randn(m, w.shape[1], dtype=dtype, device="cuda")
        with torch.no_grad():
            out = model.compute_logits(x)
        assert out.shape == (m, w.shape[0]) and bool(torch.isfinite(out).all())
        want = x.double().cpu() @ w.t()
        err = ((out.double().cpu() - want).norm() / want.norm()).item()
        assert err <= tol, f"lm_head M={m} {dtype}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensor_parallel_2_on_two_gpus_matches_tp_1(exported, dense_dir, quant_ref, tmp_path):
    """The kbit GPU paths (the mma kernel at decode sizes, the Triton / dequantize paths at
    prefill sizes; K = 2..5) on shards at TP = 2 through NCCL give the logits of TP = 1 on
    one GPU."""
    cases = [
        (exported("llama", "kbit4"), {}),
        (exported("qwen3", "kbit2"), {}),
        (exported("llama", "kbit3"), {}),
        (dense_dir("qwen3"), {"quantization": "kbit", "quantization_args": {"bits": 5}}),
        (exported("llama", "kbit4_head"), {}),
    ]
    ids = quant_ref.ids(320, seed=22, seq=9)
    batches = [ids, ids[:1, :2]]
    gpu = {"device": "cuda", "dtype": "float16"}
    results = tp2_logits([[f, {**kw, **gpu}] for f, kw in cases], batches, tmp_path)
    for (folder, kwargs), result in zip(cases, results):
        assert "error" not in result, result.get("error")
        model = quantfw.load_model(folder, **kwargs, **gpu)
        for batch, got in zip(batches, result["logits"]):
            with torch.no_grad():
                want = model(batch.cuda()).float().cpu()
            err = quant_ref.error(got, want)
            assert err <= 1e-2, f"{folder} {kwargs} {list(batch.shape)}: TP=2 vs 1: {err:.3e}"


@pytest.mark.parametrize("bits", kfmt.SUPPORTED_BITS)
def test_qwen3_8b_linear_weights_take_k_over_16_of_fp16(bits):
    """The Qwen3-8B shape (built on meta, nothing read): the kbit linears hold at most
    K/16 + 0.03 of their fp16 bytes (embedding and head excluded)."""
    from transformers import AutoConfig

    from quantfw.config import ModelConfig
    from quantfw.layers.linear import LinearBase
    from quantfw.loaders.base import initialize_model

    hf = AutoConfig.for_model(
        "qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960,
    )  # fmt: skip
    hf.architectures = ["Qwen3ForCausalLM"]
    mc = ModelConfig(
        "qwen3-8b", hf_config=hf, dtype="float16", quantization="kbit",
        quantization_args={"bits": bits},
    )  # fmt: skip
    model = initialize_model(mc, "meta")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 36 * 4
    fp16 = sum(2 * m.input_size * m.output_size for m in linears)
    kbit_bytes = sum(m.quant_method.runtime_nbytes(m) for m in linears)
    assert kbit_bytes / fp16 <= bits / 16 + 0.03
    assert kbit_bytes / fp16 == pytest.approx(bits / 16 + 1 / 64, rel=1e-3)
