"""Tuned W4A16 config tables (pure host logic) and the ``quantfw tune-w4a16`` shape listing."""

from __future__ import annotations

import json

import pytest

from quantfw.entrypoints.cli import main
from quantfw.entrypoints.cmd_tune_w4a16 import w4a16_shapes
from quantfw.kernels.w4a16 import configs as C
from quantfw.kernels.w4a16 import tables as T

MMA = ("mma", 4, 8, 8, False, True, 4)
WG = ("wg", 256, 2, 4, 3, 1)
DEQ = ("deq", 8, 4)


@pytest.fixture
def no_user_dir(monkeypatch):
    monkeypatch.delenv(T.ENV_DIR, raising=False)
    T.TABLES.cache_clear()
    yield
    T.TABLES.cache_clear()


def test_check_config_accepts_every_candidate_and_names_what_is_wrong():
    for hopper in (False, True):
        for M in (1, 16, 17, 64, 256, 1024, 4096):
            for cfg in C.candidate_configs(M, hopper) + [C.default_config(M, 64, 64, 32, hopper)]:
                assert C.check_config(cfg) == cfg
    with pytest.raises(ValueError, match=r"here: unknown kernel kind 'gemv'; kinds: mma, ring"):
        C.check_config(("gemv", 1), "here")
    with pytest.raises(ValueError, match=r"has 2 fields, wg takes \('wg', tokens, warpgroups"):
        C.check_config(("wg", 256, 2))
    with pytest.raises(ValueError, match="pipe=1 .* must be True/False"):
        C.check_config(("mma", 4, 8, 8, 1, True, 4))
    with pytest.raises(ValueError, match="warps=0 .* must be a positive integer"):
        C.check_config(("deq", 8, 0))


def test_table_round_trip_and_m_lookup(tmp_path, no_user_dir, monkeypatch):
    monkeypatch.setenv(T.ENV_DIR, str(tmp_path))
    path = tmp_path / T.file_name("Fake GPU 80GB")
    assert path.name == "w4a16-Fake_GPU_80GB.json"
    T.write_table(path, "Fake GPU 80GB", {(640, 256, 128): {1: MMA, 1024: WG, 64: DEQ}}, "test")
    doc = json.loads(path.read_text())
    assert doc["device"] == "Fake GPU 80GB" and list(doc["shapes"]) == ["N=640,K=256,G=128"]
    assert list(doc["shapes"]["N=640,K=256,G=128"]) == ["1", "64", "1024"]  # sorted by M
    assert T.load_table(path) == {(640, 256, 128): {1: MMA, 64: DEQ, 1024: WG}}
    # M -> its power-of-two bucket -> the smallest tuned M at or above it, else the largest
    expect = {1: MMA, 2: DEQ, 33: DEQ, 64: DEQ, 65: WG, 1024: WG, 1025: WG, 9999: WG}
    for M, cfg in expect.items():
        assert T.find_config("Fake GPU 80GB", M, 640, 256, 128) == cfg, M
    assert T.find_config("Fake GPU 80GB", 1, 640, 256, 64) is None  # other group size
    assert T.find_config("Other GPU", 1, 640, 256, 128) is None
    # a second write merges; new entries win
    T.write_table(path, "Fake GPU 80GB", {(640, 256, 128): {64: MMA}, (64, 64, 64): {1: DEQ}}, "")
    assert T.load_table(path) == {
        (64, 64, 64): {1: DEQ},
        (640, 256, 128): {1: MMA, 64: MMA, 1024: WG},
    }
    # untuned calls: the table where it lists the shape, the heuristic elsewhere
    assert T.untuned_config("Fake GPU 80GB", 40, 640, 256, 128, True) == MMA
    assert T.untuned_config("Fake GPU 80GB", 40, 640, 512, 128, True) == (
        C.default_config(40, 640, 512, 128, True)
    )


def test_user_dir_wins_over_the_shipped_table(tmp_path, no_user_dir, monkeypatch):
    shipped = T.load_table(T.PACKAGE_DIR / T.file_name("NVIDIA H200"))
    (N, K, G), per_m = next(iter(shipped.items()))
    assert T.find_config("NVIDIA H200", 1, N, K, G) == per_m[1]
    T.write_table(tmp_path / T.file_name("NVIDIA H200"), "NVIDIA H200", {(N, K, G): {1: DEQ}}, "")
    monkeypatch.setenv(T.ENV_DIR, str(tmp_path))
    assert T.find_config("NVIDIA H200", 1, N, K, G) == DEQ


def test_shipped_tables_are_valid_and_cover_the_benchmark_shapes(no_user_dir):
    files = sorted(T.PACKAGE_DIR.glob("w4a16-*.json"))
    assert files, "no shipped W4A16 config table"
    for f in files:
        table = T.load_table(f)  # raises on any malformed entry
        assert json.loads(f.read_text())["device"].replace(" ", "_") in f.name
        assert all(set(per_m) == {1, 4, 16, 64, 256, 1024, 4096} for per_m in table.values())
    h200 = T.load_table(T.PACKAGE_DIR / "w4a16-NVIDIA_H200.json")
    bench = {  # benchmarks/bench_w4a16.py's shapes as (N, K, G)
        (6144, 4096, 128), (4096, 4096, 128), (24576, 4096, 128), (4096, 12288, 128),
        (1280, 8192, 128), (8192, 1024, 128), (7168, 8192, 128), (8192, 3584, 128),
    }  # fmt: skip
    assert set(h200) == bench


def test_bad_tables_name_the_file_and_entry(tmp_path):
    bad = tmp_path / "w4a16-X.json"
    bad.write_text('{"shapes": {"N=64,K=64": {"1": ["deq", 8, 4]}}}')
    with pytest.raises(ValueError, match=r"w4a16-X.json: shape key 'N=64,K=64' is not of the form"):
        T.load_table(bad)
    bad.write_text('{"shapes": {"N=64,K=64,G=32": {"1": ["deq", 8]}}}')
    with pytest.raises(ValueError, match=r"w4a16-X.json: N=64,K=64,G=32 M=1: .* has 1 fields"):
        T.load_table(bad)
    bad.write_text('{"shapes": {"N=64,K=64,G=32": {"0": ["deq", 8, 4]}}}')
    with pytest.raises(ValueError, match="M=0: M must be a positive integer"):
        T.load_table(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="w4a16-X.json: not a W4A16 config table"):
        T.load_table(bad)


def test_default_on_hopper_hands_large_m_to_dequantize_plus_cublas():
    assert C.default_config(1024, 4096, 4096, 128, True)[0] == "wg"
    assert C.default_config(C.DEQ_MIN_M_HOPPER, 4096, 4096, 128, True) == DEQ
    assert [C.m_bucket(M) for M in (1, 2, 3, 16, 17, 1025)] == [1, 2, 4, 16, 32, 2048]


@pytest.fixture
def awq_checkpoint(hf_checkpoint, tmp_path):
    from quantfw.exporter import quantize_checkpoint

    _, dense = hf_checkpoint("llama")
    return quantize_checkpoint(dense, str(tmp_path / "awq"), method="awq", group_size=32)


def test_tune_lists_the_per_rank_shapes(awq_checkpoint, hf_checkpoint):
    # tiny llama: hidden 64, 4 heads + 2 kv heads of 16, intermediate 128
    assert set(w4a16_shapes(awq_checkpoint, 1)) == {
        (128, 64, 32), (64, 64, 32), (256, 64, 32), (64, 128, 32),
    }  # fmt: skip
    # tp = 2: columns split for qkv and gate_up, rows for o and down
    assert sorted(w4a16_shapes(awq_checkpoint, 2)) == [(64, 32, 32), (64, 64, 32), (128, 64, 32)]
    _, dense = hf_checkpoint("qwen3", name="dense")
    with pytest.raises(ValueError, match="4-bit awq and gptq; this model is not quantized"):
        w4a16_shapes(dense, 1)


def test_tune_command_errors_are_one_line(awq_checkpoint, capsys, monkeypatch):
    monkeypatch.delenv(T.ENV_DIR, raising=False)
    assert main(["tune-w4a16", awq_checkpoint]) == 1
    assert "pass --out-dir or set QUANTFW_W4A16_CONFIG_DIR" in capsys.readouterr().err
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["tune-w4a16", awq_checkpoint, "--out-dir", "x"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_tuned_table_serves_untuned_calls(tmp_path, monkeypatch, no_user_dir):
    """tune_shapes -> write_table -> a call without a config (and no tune() cache entry) runs
    the table's config for its M bucket, with a correct result."""
    import torch

    from quantfw.kernels import w4a16 as W
    from quantfw.kernels.w4a16.triton import dispatch as TK
    from quantfw.kernels.w4a16.triton.tuning import random_awq, tune_shapes

    N, K, G = 384, 512, 128
    table = tune_shapes([(N, K, G)], [1, 64], log=lambda s: None)
    assert set(table[(N, K, G)]) == {1, 64}
    name = torch.cuda.get_device_name()
    T.write_table(tmp_path / T.file_name(name), name, table, "test")
    monkeypatch.setenv(T.ENV_DIR, str(tmp_path))
    TK._CONFIG_CACHE.clear()
    packed = random_awq(K, N, G, "cuda")
    ref_w = W.dequantize_packed(packed, torch.float32)
    for M, tuned_m in ((1, 1), (3, 64), (64, 64)):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        out = W.w4a16_matmul(x, packed)
        assert TK._CONFIG_CACHE[TK._key(x, packed)] == table[(N, K, G)][tuned_m]
        ref = x.float() @ ref_w
        assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-3
    TK._CONFIG_CACHE.clear()
