"""The method-independent part of export: read the dense checkpoint, stream its tensors through
a `MethodExporter`, write shards, config.json and the tokenizer files."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from quantfw.loaders.weight_utils import (
    PT_INDEX,
    SAFETENSORS_INDEX,
    download_snapshot,
    find_weight_files,
    iterate_pt,
    iterate_safetensors,
)

_METADATA_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")

#: the decoder's linear layers that export quantizes (embeddings, norms, lm_head keep their dtype)
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class MethodExporter(Protocol):
    """One quantization method's export: the tensors it writes and its quantization_config."""

    def quantization_config(self) -> dict[str, Any]: ...

    def convert(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]: ...


#: method name -> "module:attr" of ``build(method, args, hf_config) -> MethodExporter``; `build`
#: validates `args` (the method's options) and rejects unknown or unsupported ones by name.
EXPORT_METHODS: dict[str, str] = {
    "awq": "quantfw.exporter.int4:build",
    "gptq": "quantfw.exporter.int4:build",
    "kbit": "quantfw.exporter.kbit:build",
    "mxfp4": "quantfw.exporter.mxfp4:build",
}


def quantize_linears(
    tensors: Iterator[tuple[str, torch.Tensor]],
    quantize_linear: Callable[[str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]],
    *,
    also: tuple[str, ...] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor as it is, except the 2-D ``weight`` of a `QUANTIZED_LINEARS` layer or of a
    layer whose whole prefix is in `also` (``"lm_head"``), which ``quantize_linear(prefix,
    weight)`` replaces by the tensors it yields. A prefix of `also` that holds no such weight
    is an error."""
    missing = set(also)
    for name, tensor in tensors:
        prefix, _, kind = name.rpartition(".")
        quantized = prefix.split(".")[-1] in QUANTIZED_LINEARS or prefix in also
        if kind == "weight" and tensor.dim() == 2 and quantized:
            missing.discard(prefix)
            yield from quantize_linear(prefix, tensor)
        else:
            yield name, tensor
    if missing:
        raise ValueError(
            f"export: no 2-D weight found for {sorted(missing)}, which was asked to be quantized"
        )


def register_export_method(name: str, target: str) -> None:
    """Make ``quantize_checkpoint(method=name)`` use the builder at ``"module:attr"``."""
    EXPORT_METHODS[name.lower()] = target


def _builder(method: str):
    target = EXPORT_METHODS.get(method)
    if target is None:
        raise ValueError(f"unknown method {method!r}; supported: {sorted(EXPORT_METHODS)}")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def quantize_checkpoint(
    model_path: str,
    out_dir: str,
    *,
    method: str,
    max_shard_size: int = 4 * 2**30,
    **method_args: Any,
) -> str:
    """Quantize the dense checkpoint `model_path` (folder or hub id) with `method` into
    `out_dir`; returns `out_dir`. `method_args` are the method's options (e.g. ``bits``,
    ``group_size``); `max_shard_size` is in bytes."""
    method = method.lower()
    build = _builder(method)
    folder = download_snapshot(model_path)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(
            f"{model_path!r} is already quantized "
            f"({config['quantization_config'].get('quant_method')}); export needs a dense checkpoint"
        )
    exporter = build(method, dict(method_args), config)
    files, use_safetensors = find_weight_files(folder)
    reader = iterate_safetensors if use_safetensors else iterate_pt

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        for path in files:
            yield from reader(path)

    os.makedirs(out_dir, exist_ok=True)
    write_shards(exporter.convert(source()), out_dir, max_shard_size)
    config["quantization_config"] = exporter.quantization_config()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in sorted(os.listdir(folder)):
        if (
            name.endswith(_METADATA_SUFFIXES)
            and name not in ("config.json", SAFETENSORS_INDEX, PT_INDEX)
            and os.path.isfile(os.path.join(folder, name))
        ):
            shutil.copyfile(os.path.join(folder, name), os.path.join(out_dir, name))
    return out_dir


def write_shards(
    tensors: Iterator[tuple[str, torch.Tensor]], out_dir: str, max_shard_bytes: int
) -> None:
    """Write safetensors shards of at most `max_shard_bytes` (one tensor may exceed it) as they
    fill, then name them model-XXXXX-of-YYYYY with an index (or model.safetensors if one)."""
    from safetensors.torch import save_file

    written: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = os.path.join(out_dir, f".shard-{len(written):05d}.tmp")
        save_file(shard, path, metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    if shard or not written:
        flush()
    if len(written) == 1:
        os.replace(written[0][0], os.path.join(out_dir, "model.safetensors"))
        return
    weight_map = {}
    for i, (path, names) in enumerate(written, 1):
        filename = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        os.replace(path, os.path.join(out_dir, filename))
        weight_map.update(dict.fromkeys(names, filename))
    with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
