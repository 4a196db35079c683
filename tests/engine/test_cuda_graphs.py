"""CUDA graphs for decode give the same greedy tokens as eager decode (GPU only)."""

from __future__ import annotations

import pytest
import torch

from quantfw.engine import LLM, SamplingParams

PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14, 15], [1, 30], [1, 40, 41, 42, 43, 44, 45]]


def _greedy_with_and_without_graphs(model, dtype, backend, check_llm=None):
    """Greedy tokens of PROMPTS with CUDA-graph decode off and on: {False: ..., True: ...}."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(
            model,
            dtype=dtype,
            max_num_seqs=4,
            max_model_len=128,
            cuda_graphs=graphs,
            attention_backend=backend,
        )
        assert (llm.engine.runner.graphs is not None) == graphs
        if check_llm is not None:
            check_llm(llm)
        outs[graphs] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        del llm
        torch.cuda.empty_cache()
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_cuda_graph_decode_matches_eager(tiny_llama, backend, dtype):
    outs = _greedy_with_and_without_graphs(tiny_llama, dtype, backend)
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_triton_backend_matches_transformers_in_float32(tiny_qwen3):
    from tiny_checkpoint import hf_greedy

    greedy = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(tiny_qwen3, dtype="float32", max_num_seqs=2, max_num_batched_tokens=8)
    assert llm.engine.runner.backend.name == "triton"
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    assert got == hf_greedy(tiny_qwen3, PROMPTS, 12)


def test_cuda_graphs_refused_on_cpu(tiny_llama):
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM(tiny_llama, max_num_seqs=2, cuda_graphs=True)


@pytest.mark.gpu
def test_awq_fp16_cuda_graphs_match_eager(tiny_llama, tmp_path):
    """The W4A16 kernels (split-K workspace, per-bucket configs) inside captured decode steps."""
    from quantfw import exporter

    awq = exporter.quantize_checkpoint(
        tiny_llama, str(tmp_path / "awq"), method="awq", group_size=32
    )

    def uses_w4a16(llm):
        model = llm.engine.runner.model
        layers = [m for m in model.modules() if getattr(m, "w4a16_qweight", None) is not None]
        assert layers, "no layer runs the W4A16 kernels"

    outs = _greedy_with_and_without_graphs(awq, "float16", "sdpa", uses_w4a16)
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_windows_match_single_steps(tiny_llama, dtype):
    """Greedy feedback on the device (several decode steps per host round trip) gives the
    tokens of one step at a time, with max_tokens that end mid-window and a stop token."""
    lengths = [5, 12, 17, 9]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = {}
    for window in (1, 8):
        llm = LLM(tiny_llama, dtype=dtype, max_num_seqs=4, max_model_len=128, decode_window=window)
        assert llm.engine.decode_window == window
        outs[window] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        if window == 1:
            stop = outs[1][2][6]  # a token the third prompt produces mid-way
        stopped = SamplingParams(temperature=0, max_tokens=17, stop_token_ids=[stop])
        outs[f"stop{window}"] = llm.generate(PROMPTS[2], stopped)[0].outputs[0].token_ids
        assert llm.engine.kv_cache.num_free == llm.engine.kv_cache.initial_free
        del llm
        torch.cuda.empty_cache()
    assert outs[8] == outs[1]
    assert [len(t) for t in outs[8]] == lengths
    assert outs["stop8"] == outs["stop1"] and outs["stop8"][-1] == stop


@pytest.mark.gpu
def test_decode_windows_end_early_for_arrivals(tiny_llama):
    """With `arrivals_waiting` saying yes now and then, windows end after two or more of their
    steps (the engine asks before each further one), and the tokens and the free cache are
    those of whole windows."""
    lengths = [30, 41, 26, 37]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs, ran = {}, {}
    for early in (False, True):
        llm = LLM(tiny_llama, dtype="float32", max_num_seqs=4, max_model_len=128)
        engine, asked = llm.engine, []
        if early:
            engine.arrivals_waiting = lambda a=asked: a.append(1) or len(a) % 3 == 0
        execute, windows = engine.runner.execute, ran.setdefault(early, [])

        def recorded(batch, window=1, stop=None, execute=execute, windows=windows):
            out = execute(batch, window, stop)
            if window > 1:
                windows.append((window, out.shape[0]))
            return out

        engine.runner.execute = recorded
        outs[early] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert engine.kv_cache.num_free == engine.kv_cache.initial_free
        assert bool(asked) == early
        del llm, engine
        torch.cuda.empty_cache()
    assert outs[True] == outs[False] and [len(t) for t in outs[True]] == lengths
    assert all(n == w for w, n in ran[False])
    assert all(2 <= n <= w for w, n in ran[True]) and any(n < w for w, n in ran[True])


def test_decode_window_needs_cuda_graphs(tiny_llama):
    with pytest.raises(ValueError, match="decode_window"):
        LLM(tiny_llama, max_num_seqs=2, decode_window=4, cuda_graphs=False)


def _one_sequence_greedy(model, dtype, graphs, monkeypatch, fused):
    """Greedy tokens of one prompt decoding alone (one token a step), with the q/k/v
    projection's rotary epilogue on or off; the number of projections it served."""
    from rope_store import watch_rope_store

    served = watch_rope_store(monkeypatch, fused)
    llm = LLM(model, dtype=dtype, max_num_seqs=1, max_model_len=128, cuda_graphs=graphs)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = llm.generate([PROMPTS[1]], greedy)[0].outputs[0].token_ids
    del llm
    torch.cuda.empty_cache()
    return tokens, sum(served)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_decode_projection_rotates_and_stores_as_attention_did(tiny_llama, graphs, monkeypatch):
    """A bfloat16 Llama decoding one sequence: its q/k/v projections take the GEMV's rotary
    epilogue (k and v straight to the cache), and the greedy tokens are those of the separate
    rotary-and-store kernel."""
    fused, served = _one_sequence_greedy(tiny_llama, "bfloat16", graphs, monkeypatch, True)
    assert served > 0
    plain, _ = _one_sequence_greedy(tiny_llama, "bfloat16", graphs, monkeypatch, False)
    assert fused == plain
