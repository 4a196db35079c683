"""Run under torchrun: load each checkpoint folder given on the command line with quantfw and
save rank 0's logits (or the error message) to OUT_DIR/<index>.pt."""

from __future__ import annotations

import os
import sys

import torch

import quantfw
from quantfw import distributed as qdist


def main() -> None:
    out_dir, folders = sys.argv[1], sys.argv[2:]
    qdist.init_distributed()
    for index, folder in enumerate(folders):
        torch.manual_seed(1234 + index)
        ids = torch.randint(0, 300, (2, 23))
        try:
            model = quantfw.load_model(folder, device="cpu", dtype="float32")
            with torch.no_grad():
                result = {"logits": model(ids), "ids": ids}
        except ValueError as e:
            result = {"error": str(e)}
        if qdist.get_tp_rank() == 0:
            torch.save(result, os.path.join(out_dir, f"{index}.pt"))
    qdist.destroy_distributed()


if __name__ == "__main__":
    main()
