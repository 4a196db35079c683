"""Run under torchrun: load each checkpoint folder given on the command line with quantfw and
save rank 0's logits (or the error message) to OUT_DIR/<index>.pt.

``tp_logits.py OUT_DIR FOLDER... [--load-format dummy]``
"""

from __future__ import annotations

import argparse
import os

import torch

import quantfw
from quantfw import distributed as qdist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--load-format", default="auto")
    args = ap.parse_args()
    qdist.init_distributed()
    for index, folder in enumerate(args.folders):
        torch.manual_seed(1234 + index)
        ids = torch.randint(0, 300, (2, 23))
        try:
            model = quantfw.load_model(
                folder, device="cpu", dtype="float32", load_format=args.load_format
            )
            with torch.no_grad():
                result = {"logits": model(ids), "ids": ids}
        except ValueError as e:
            result = {"error": str(e)}
        if qdist.get_tp_rank() == 0:
            torch.save(result, os.path.join(args.out_dir, f"{index}.pt"))
    qdist.destroy_distributed()


if __name__ == "__main__":
    main()
