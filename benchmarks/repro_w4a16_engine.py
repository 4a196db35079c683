"""Debug aid: the W4A16 (AWQ) engine path at Qwen3-8B shapes, eager then with CUDA graphs, one
workload per batch size; run with CUDA_LAUNCH_BLOCKING=1 to find a failing kernel launch."""

from __future__ import annotations

import sys
import tempfile

import torch
from profile_decode import decode_rate, make_model_dir

from quantfw.engine import LLMEngine


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with tempfile.TemporaryDirectory() as root:
        path = make_model_dir(root, layers, "awq")
        for graphs in (False, True):
            engine = LLMEngine(
                path, dtype="float16", load_format="dummy", max_model_len=4096, max_num_seqs=16,
                tokenizer=None, cuda_graphs=graphs,
            )  # fmt: skip
            for b in (1, 2, 16):
                print(f"graphs={graphs} bs={b}", flush=True)
                print(f"  {decode_rate(engine, b, 16, 8):.1f} tok/s", flush=True)
            del engine
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
