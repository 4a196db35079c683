"""Where a benchmark's model shape comes from: an HF ``config.json`` (bundled, local or on the hub),
written alone into a folder that the engine loads with dummy weights."""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any


def bundled_configs() -> list[str]:
    """Names of the configs shipped in ``quantfw/data`` (``qwen3-8b``, ``tiny-llama``...)."""
    root = resources.files("quantfw.data")
    return sorted(
        entry.name.replace("_", "-")
        for entry in root.iterdir()
        if entry.is_dir() and entry.joinpath("config.json").is_file()
    )


def read_hf_config(source: str, *, revision: str | None = None) -> tuple[dict[str, Any], str]:
    """(config dict, short label) for `source`: a bundled name, a folder holding config.json, a
    config.json path, or a hub repo id (only its config.json is fetched)."""
    bundled = source.lower().replace("_", "-")
    if bundled in bundled_configs():
        entry = resources.files("quantfw.data").joinpath(bundled.replace("-", "_"), "config.json")
        return json.loads(entry.read_text()), bundled
    if os.path.isdir(source):
        path, label = os.path.join(source, "config.json"), os.path.abspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"folder {source!r} has no config.json")
    elif os.path.isfile(source):
        path, label = source, os.path.dirname(os.path.abspath(source))
    elif os.path.exists(source) or source.endswith(".json") or source.count("/") != 1:
        raise ValueError(
            f"{source!r} is not a bundled config ({', '.join(bundled_configs())}), a folder with "
            "config.json, a config.json file or a hub repo id (owner/name)"
        )
    else:
        from huggingface_hub import hf_hub_download

        try:
            path, label = hf_hub_download(source, "config.json", revision=revision), source
        except Exception as e:  # offline, no such repo, gated: the user needs the message
            raise ValueError(f"cannot fetch config.json of hub repo {source!r}: {e}") from e
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read HF config {path!r}: {e}") from e
    if not isinstance(config, dict) or "architectures" not in config:
        raise ValueError(f"{path!r} is not an HF model config (no 'architectures')")
    return config, os.path.basename(label.rstrip("/"))


def write_config_folder(
    config: dict[str, Any], folder: str, quantization_config: dict[str, Any] | None = None
) -> str:
    """Write `config` (without any checkpoint quantization_config, with `quantization_config`
    when given) as ``folder/config.json``; the folder is a weight-free model for dummy loading."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if quantization_config is not None:
        config["quantization_config"] = dict(quantization_config)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return folder
