"""Run under torchrun: ``tp_load_logits.py CASES_JSON IDS_PT OUT_PT``. CASES_JSON is a list of
``[folder, load_model kwargs]`` (default ``device="cpu", dtype="float32"``; ``"device": "cuda"``
puts each rank on its own GPU and joins them through NCCL, the CPU through gloo); IDS_PT holds a
list of token-id batches. Rank 0 saves, per case, the float32 logits of every batch (or the
error message) as a list to OUT_PT."""

from __future__ import annotations

import json
import sys

import torch

import quantfw
from quantfw import distributed as qdist


def main() -> None:
    cases_path, ids_path, out_path = sys.argv[1:4]
    with open(cases_path) as f:
        cases = [
            [folder, {"device": "cpu", "dtype": "float32", **kw}] for folder, kw in json.load(f)
        ]
    batches = torch.load(ids_path)
    devices = {kw["device"] for _, kw in cases}
    if len(devices) != 1:
        raise SystemExit(f"tp_load_logits.py: one device for all cases, got {sorted(devices)}")
    on_gpu = devices == {"cuda"}
    qdist.init_distributed(backend="nccl" if on_gpu else "gloo")
    results = []
    for folder, kwargs in cases:
        if on_gpu:
            kwargs["device"] = qdist.default_device()
        try:
            model = quantfw.load_model(folder, **kwargs)
            with torch.no_grad():
                logits = [model(ids.to(kwargs["device"])).float().cpu() for ids in batches]
            results.append({"logits": logits})
        except ValueError as e:
            results.append({"error": str(e)})
    if qdist.get_tp_rank() == 0:
        torch.save(results, out_path)
    qdist.destroy_distributed()


if __name__ == "__main__":
    main()
