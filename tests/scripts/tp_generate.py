"""Run under torchrun: greedy generation through the engine at the world's TP size, with a cache
small enough to force chunked prefill and preemption; rank 0 saves the tokens to OUT."""

from __future__ import annotations

import sys

import torch

from quantfw import distributed as qdist
from quantfw.engine import LLM, SamplingParams


def main() -> None:
    out, folder = sys.argv[1], sys.argv[2]
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
