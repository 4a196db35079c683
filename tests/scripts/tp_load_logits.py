"""Run under torchrun: ``tp_load_logits.py CASES_JSON IDS_PT OUT_PT``. CASES_JSON is a list of
``[folder, load_model kwargs]``; rank 0 saves the float32 logits of each case for the token ids
in IDS_PT (or the error message) as a list to OUT_PT."""

from __future__ import annotations

import json
import sys

import torch

import quantfw
from quantfw import distributed as qdist


def main() -> None:
    cases_path, ids_path, out_path = sys.argv[1:4]
    with open(cases_path) as f:
        cases = json.load(f)
    ids = torch.load(ids_path)
    qdist.init_distributed()
    results = []
    for folder, kwargs in cases:
        try:
            model = quantfw.load_model(folder, device="cpu", dtype="float32", **kwargs)
            with torch.no_grad():
                results.append({"logits": model(ids)})
        except ValueError as e:
            results.append({"error": str(e)})
    if qdist.get_tp_rank() == 0:
        torch.save(results, out_path)
    qdist.destroy_distributed()


if __name__ == "__main__":
    main()
