"""Run under torchrun: greedy generation through the engine at the world's TP size, with a cache
small enough to force chunked prefill and preemption; rank 0 saves the tokens to OUT.

``tp_generate.py OUT FOLDER one-sequence-gpu [unfused | eager-prefill]``: instead one prompt
decoding alone on the GPU in bfloat16 under CUDA graphs (one token a step; its prefill replayed
as a graph too), with the q/k/v projection's rotary epilogue
(`kernels.dense.ops.linear_rope_store`), or with ``unfused`` without it, or with
``eager-prefill`` its prefill run eagerly."""

from __future__ import annotations

import sys

import torch

from quantfw import distributed as qdist
from quantfw.engine import LLM, SamplingParams


def _count_prefill_graphs(llm: LLM) -> list[int]:
    """The token counts of the prefill steps `llm` replays as graphs, as they run. No local
    here outlives the call: graphs still referenced at `destroy_distributed` (they captured
    NCCL collectives) hang the process group's teardown."""
    replayed: list[int] = []
    graphs = llm.engine.runner.prefill_graphs
    if graphs is not None:
        replay = graphs.run

        def counted(step):
            replayed.append(step.num_tokens)
            return replay(step)

        graphs.run = counted
    return replayed


def one_sequence_gpu(out: str, folder: str, fused: bool, prefill_graphs: bool) -> None:
    from quantfw.kernels.dense import ops

    real, served = ops.linear_rope_store, []

    def counted(*args):
        q = real(*args) if fused else None
        served.append(q is not None)
        return q

    ops.linear_rope_store = counted
    llm = LLM(folder, device="cuda", dtype="bfloat16", block_size=4, max_num_seqs=1,
              cuda_graphs=True, prefill_graph_tokens=None if prefill_graphs else 0)  # fmt: skip
    replayed = _count_prefill_graphs(llm)
    prompt = [1, 17, 45, 102, 7, 66, 250, 31, 9, 4, 77, 150, 12]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
    if qdist.get_tp_rank() == 0:
        torch.save({"tokens": tokens, "served": sum(served), "prefill_graphs": replayed}, out)
    # the LLM stays referenced: its runner drops its CUDA graphs through the teardown hook
    qdist.destroy_distributed()


def main() -> None:
    out, folder = sys.argv[1], sys.argv[2]
    if sys.argv[3:4] == ["one-sequence-gpu"]:
        mode = sys.argv[4:5]
        one_sequence_gpu(out, folder, mode != ["unfused"], mode != ["eager-prefill"])
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
