"""Run under torchrun: greedy generation through the engine at the world's TP size, with a cache
small enough to force chunked prefill and preemption; rank 0 saves the tokens to OUT.

``tp_generate.py OUT FOLDER one-sequence-gpu [unfused]``: instead one prompt decoding alone on
the GPU in bfloat16 under CUDA graphs (one token a step), with the q/k/v projection's rotary
epilogue (`kernels.dense.ops.linear_rope_store`), or with ``unfused`` without it."""

from __future__ import annotations

import sys

import torch

from quantfw import distributed as qdist
from quantfw.engine import LLM, SamplingParams


def one_sequence_gpu(out: str, folder: str, fused: bool) -> None:
    from quantfw.kernels.dense import ops

    real, served = ops.linear_rope_store, []

    def counted(*args):
        q = real(*args) if fused else None
        served.append(q is not None)
        return q

    ops.linear_rope_store = counted
    llm = LLM(folder, device="cuda", dtype="bfloat16", block_size=4, max_num_seqs=1,
              cuda_graphs=True)  # fmt: skip
    prompt = [1, 17, 45, 102, 7, 66, 250, 31, 9, 4, 77, 150, 12]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
    if qdist.get_tp_rank() == 0:
        torch.save({"tokens": tokens, "served": sum(served)}, out)
    # the LLM stays referenced: its runner drops the decode graphs through the teardown hook
    qdist.destroy_distributed()


def main() -> None:
    out, folder = sys.argv[1], sys.argv[2]
    if sys.argv[3:4] == ["one-sequence-gpu"]:
        one_sequence_gpu(out, folder, fused=sys.argv[4:5] != ["unfused"])
        return
    prompts = [list(range(1, 4 + 5 * i)) for i in range(4)]
    llm = LLM(
        folder,
        device="cpu",
        dtype="float32",
        max_model_len=48,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        block_size=4,
        num_gpu_blocks=16,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    if qdist.get_tp_rank() == 0:
        preemptions = llm.engine.scheduler.num_preemptions
        torch.save(
            {"tokens": [o.outputs[0].token_ids for o in outs], "preemptions": preemptions}, out
        )
    qdist.destroy_distributed()


if __name__ == "__main__":
    main()
