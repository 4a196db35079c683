"""The FlashInfer attention backend gives SDPA's greedy tokens, chunked prefill included (GPU,
when flashinfer is installed); bad combinations are clear errors."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoint import build_model

from quantfw.engine import LLM, SamplingParams
from quantfw.layers.attention import select_backend

PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 30], [1, 40, 41, 42]]


@pytest.mark.gpu
def test_flashinfer_matches_sdpa(tmp_path):
    pytest.importorskip("flashinfer")
    # head_dim 64: a size FlashInfer's kernels are built for
    model = build_model(str(tmp_path / "llama"), "llama", hidden_size=256)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("sdpa", "flashinfer"):
        llm = LLM(
            model,
            dtype="float16",
            max_num_seqs=4,
            max_model_len=128,
            max_num_batched_tokens=8,  # the 12-token prompt is prefilled in chunks
            cuda_graphs=False,
            attention_backend=backend,
        )
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        del llm
        torch.cuda.empty_cache()
    assert outs["flashinfer"] == outs["sdpa"]


def test_flashinfer_needs_half_precision_and_cuda():
    with pytest.raises(ValueError, match="needs a float16 or bfloat16 model"):
        select_backend("flashinfer", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("flashinfer", torch.device("cpu"), torch.float16)
    assert select_backend("auto", torch.device("cpu"), torch.float16).name == "sdpa"
    with pytest.raises(ValueError, match="unknown attention_backend 'xformers'"):
        select_backend("xformers", torch.device("cpu"), torch.float16)
