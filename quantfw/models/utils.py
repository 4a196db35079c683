"""The shared weight-loading loop: checkpoint names -> parameters, with strict accounting."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from quantfw.layers.sharding import ShardShapeError, copy_shard


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model: names the tensor, the parameter and the shapes.
    `tensor_name` lets the loader add the file the tensor came from."""

    def __init__(self, message: str, *, tensor_name: str | None = None):
        super().__init__(message)
        self.tensor_name = tensor_name


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    copy_shard(param, loaded, dim=None)


def map_checkpoint_name(
    name: str, stacked_params_mapping: list[tuple[str, str, Any]]
) -> tuple[str, Any]:
    """(parameter name, shard id) for a checkpoint tensor name; shard id None if not stacked.
    A checkpoint part matches a whole run of dotted name parts, the leaf included (so
    ``self_attn.sinks`` maps ``model.layers.0.self_attn.sinks``)."""
    dotted = "." + name + "."
    for param_part, ckpt_part, shard_id in stacked_params_mapping:
        needle = "." + ckpt_part + "."
        if needle in dotted:
            return dotted.replace(needle, "." + param_part + ".", 1)[1:-1], shard_id
    return name, None


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked_params_mapping: list[tuple[str, str, Any]] | None = None,
    skip_patterns: Iterable[str] = (),
    strict: bool = True,
) -> set[str]:
    """Load `weights` into `model`'s parameters through each parameter's `weight_loader`.

    A checkpoint tensor matching a `skip_patterns` regex is skipped on purpose (rotary caches,
    a tied lm_head). With `strict`, a tensor that maps to no parameter, a tensor loaded twice,
    and a parameter (or one part of a stacked parameter) that got no data are errors.
    Returns the names of the parameters that were fully loaded.
    """
    mapping = list(stacked_params_mapping or [])
    skips = [re.compile(p) for p in skip_patterns]
    params = dict(model.named_parameters())
    received: dict[str, set] = {}
    for name, tensor in weights:
        if any(p.search(name) for p in skips):
            continue
        target, shard_id = map_checkpoint_name(name, mapping)
        param = params.get(target)
        if param is None:
            if strict:
                hint = f" (mapped to {target!r})" if target != name else ""
                raise WeightLoadError(
                    f"checkpoint tensor {name!r}{hint} of shape {tuple(tensor.shape)} maps to no "
                    f"parameter of {type(model).__name__}",
                    tensor_name=name,
                )
            continue
        seen = received.setdefault(target, set())
        if shard_id in seen:
            raise WeightLoadError(
                f"checkpoint tensor {name!r} loads parameter {target!r}"
                f"{'' if shard_id is None else f' shard {shard_id!r}'} a second time "
                "(a duplicate or consolidated copy of the weights?)",
                tensor_name=name,
            )
        seen.add(shard_id)
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except (ShardShapeError, ValueError) as e:
            raise WeightLoadError(
                f"checkpoint tensor {name!r} -> parameter {target!r}: {e}", tensor_name=name
            ) from e
    complete = _complete_parameters(params, received, mapping)
    if strict:
        missing = sorted(set(params) - complete)
        if missing:
            details = [_describe_missing(n, received.get(n), mapping) for n in missing]
            shown = "; ".join(details[:20]) + (
                f"; ... {len(details) - 20} more" if len(details) > 20 else ""
            )
            raise WeightLoadError(
                f"{len(missing)} parameter(s) of {type(model).__name__} got no data from the "
                f"checkpoint: {shown}"
            )
    return complete


def _expected_shards(name: str, mapping: list[tuple[str, str, Any]]) -> set:
    dotted = "." + name + "."
    return {shard for part, _, shard in mapping if "." + part + "." in dotted}


def _complete_parameters(
    params: dict[str, nn.Parameter], received: dict[str, set], mapping: list
) -> set[str]:
    complete = set()
    for name, shards in received.items():
        expected = _expected_shards(name, mapping)
        if None in shards or not expected or expected <= shards:
            complete.add(name)
    return complete


def _describe_missing(name: str, shards: set | None, mapping: list) -> str:
    expected = _expected_shards(name, mapping)
    if shards and expected:
        lacking = sorted(map(str, expected - shards))
        return f"{name!r} (missing shard(s) {', '.join(lacking)})"
    return repr(name)
