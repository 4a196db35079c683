"""Where a GPT-OSS-20B decode step's GPU time goes (bundled config, dummy weights, CUDA graphs),
MXFP4 experts and the bf16-expert twin: kernels grouped by kind with `profile_decode.kind_of`
plus the MoE kernels, per decode step. With ``--random-prompts`` each sequence gets its own
random 128-token prompt (as `quantfw bench` draws them), so a batch's tokens route to different
experts; otherwise every sequence has the same prompt (and the same experts).

    python benchmarks/profile_gpt_oss.py --batch-sizes 1,16 --out $OUT/profile-gpt-oss.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
import profile_decode  # noqa: E402

MOE_KINDS = [
    # FlashInfer's CUTLASS fused MoE (mxfp4-flashinfer): its grouped GEMMs and routing kernels
    # (first: CUTLASS's template names contain words the patterns below match)
    ("moe flashinfer", r"cutlass|tensorrt_llm"),
    ("moe lookup mma", r"kbit_mma"),
    ("moe grouped gemm", r"grouped_gemm"),
    ("moe dequantize", r"_dequantize_kernel"),
    ("moe sort/combine", r"align|combine"),
    ("swiglu", r"swiglu"),
]
profile_decode.KINDS[:0] = MOE_KINDS


def main() -> None:
    from quantfw.bench.configs import read_hf_config, write_config_folder
    from quantfw.engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--random-prompts", action="store_true")
    ap.add_argument(
        "--methods",
        default="mxfp4,bf16",
        help="mxfp4 experts, mxfp4-flashinfer (the same through FlashInfer), bf16 experts",
    )
    args = ap.parse_args()
    config, _ = read_hf_config("gpt-oss-20b")
    report = {
        "device": torch.cuda.get_device_name(),
        "prompts": "random" if args.random_prompts else "same",
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        mxfp4 = config["quantization_config"]
        quants = {
            "mxfp4": (mxfp4, {}),
            "mxfp4-flashinfer": (mxfp4, {"quantization_args": {"moe_backend": "flashinfer"}}),
            "bf16": (None, {}),
        }
        for name in args.methods.split(","):
            quant, extra = quants[name]
            folder = write_config_folder(config, os.path.join(tmp, name), quant)
            engine = LLMEngine(
                folder, dtype="bfloat16", load_format="dummy", max_model_len=1024,
                max_num_seqs=16, cuda_graphs=True, decode_window=1, **extra,
            )  # fmt: skip
            for b in (int(x) for x in args.batch_sizes.split(",")):
                gen = torch.Generator().manual_seed(b)
                prompts = [
                    torch.randint(0, config["vocab_size"], (128,), generator=gen).tolist()
                    for _ in range(b)
                ]
                prof = profile_decode.profile_steps(
                    engine, b, prompts=prompts if args.random_prompts else None
                )
                total = sum(prof["by_kind_us"].values())
                print(f"{name} bs={b}: {total:.0f} us of GPU time per step", flush=True)
                for kind, us in sorted(prof["by_kind_us"].items(), key=lambda kv: -kv[1]):
                    print(f"  {kind:18s} {us:8.1f} us  {100 * us / total:5.1f}%", flush=True)
                for kernel, us in prof["top_kernels_us"].items():
                    short = re.sub(r"\s+", " ", kernel)
                    print(f"    {us:8.1f} us  {short}", flush=True)
                report["runs"][f"{name}-bs{b}"] = {"step_gpu_us": total, **prof}
            del engine
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
