"""Copies of a checkpoint folder with an edited quantization_config and/or edited tensors, for
tests of bad checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import torch


def edited_copy(
    src: str,
    dst,
    *,
    config: dict | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> str:
    """Copy `src` to `dst`, update its quantization_config with `config` and let `tensors`
    edit the state dict of model.safetensors in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["quantization_config"].update(config)
        with open(path, "w") as f:
            json.dump(cfg, f)
    if tensors:
        path = os.path.join(dst, "model.safetensors")
        state = load_file(path)
        tensors(state)
        save_file(state, path, metadata={"format": "pt"})
    return str(dst)
