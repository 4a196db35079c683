"""Finding weight files (local folder or hub snapshot) and iterating their tensors."""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterator

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"

#: Files that training frameworks leave beside the weights; never weights themselves.
TRAINING_LEFTOVERS = (
    "training_args.bin",
    "optimizer.bin",
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "trainer_state*",
)

_PATTERNS = {
    "safetensors": ["*.safetensors"],
    "pt": ["*.bin", "*.pt"],
    "auto": ["*.safetensors", "*.bin", "*.pt"],
}

#: Non-weight files a snapshot needs (config, tokenizer, generation config).
_METADATA_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


class WeightFileError(ValueError):
    """A weight file is missing, unreadable or truncated."""


def weight_patterns(load_format: str) -> list[str]:
    if load_format not in _PATTERNS:
        raise ValueError(f"load_format {load_format!r} has no weight files; use {list(_PATTERNS)}")
    return _PATTERNS[load_format]


def download_snapshot(
    model: str,
    *,
    load_format: str = "auto",
    revision: str | None = None,
    cache_dir: str | None = None,
    ignore_patterns: list[str] | None = None,
) -> str:
    """A local folder for `model`: the folder itself, or a hub snapshot holding only the first
    weight format the repo has (safetensors before .bin). Honours HF_HUB_OFFLINE and the HF cache."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import HfApi, constants, snapshot_download

    patterns = weight_patterns(load_format)
    offline = constants.HF_HUB_OFFLINE
    if not offline:
        try:
            repo_files = HfApi().list_repo_files(model, revision=revision)
        except Exception as e:
            raise WeightFileError(f"cannot list the files of hub repo {model!r}: {e}") from e
        for pattern in patterns:
            if fnmatch.filter(repo_files, pattern):
                patterns = [pattern]
                break
    try:
        return snapshot_download(
            model,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=patterns + _METADATA_PATTERNS,
            ignore_patterns=ignore_patterns or None,
            local_files_only=offline,
        )
    except Exception as e:
        raise WeightFileError(
            f"cannot get {model!r} from the hub{' cache (HF_HUB_OFFLINE is set)' if offline else ''}: {e}"
        ) from e


def _is_leftover(filename: str) -> bool:
    return any(fnmatch.fnmatch(filename, p) for p in TRAINING_LEFTOVERS)


def find_weight_files(
    folder: str, load_format: str = "auto", ignore_patterns: list[str] | None = None
) -> tuple[list[str], bool]:
    """(files, use_safetensors). Safetensors first; when an index file exists only the files it
    names are kept, so a stray consolidated copy beside the shards is not loaded twice."""
    names = sorted(os.listdir(folder))
    ignore = list(ignore_patterns or [])
    for pattern in weight_patterns(load_format):
        files = [
            n
            for n in fnmatch.filter(names, pattern)
            if not _is_leftover(n) and not any(fnmatch.fnmatch(n, p) for p in ignore)
        ]
        if files:
            break
    else:
        raise WeightFileError(
            f"no weight files matching {weight_patterns(load_format)} in {folder!r}"
        )
    use_safetensors = pattern == "*.safetensors"
    index_path = os.path.join(folder, SAFETENSORS_INDEX if use_safetensors else PT_INDEX)
    if os.path.exists(index_path):
        with open(index_path) as f:
            indexed = set(json.load(f)["weight_map"].values())
        absent = sorted(indexed - set(files))
        if absent:
            raise WeightFileError(f"{index_path} names files that are not in {folder!r}: {absent}")
        files = [n for n in files if n in indexed]
    return [os.path.join(folder, n) for n in files], use_safetensors


def iterate_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except Exception as e:
        raise WeightFileError(f"cannot read safetensors file {path!r}: {e}") from e
    with handle as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            try:
                tensor = f.get_tensor(name)
            except Exception as e:
                raise WeightFileError(
                    f"cannot read tensor {name!r} from {path!r} (truncated file?): {e}"
                ) from e
            yield name, tensor


def iterate_pt(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightFileError(f"cannot read PyTorch weight file {path!r}: {e}") from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise WeightFileError(f"{path!r} holds a {type(state).__name__}, not a state dict")
    yield from state.items()
