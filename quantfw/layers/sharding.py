"""The one place that narrows a checkpoint tensor onto a parameter's tensor-parallel shard.

Parameters carry their own sharding facts as attributes:

- ``output_dim`` / ``input_dim``: which tensor dimension runs along the layer's output / input
  features (absent: that dimension is not sharded, the tensor is loaded whole).
- ``packed_dim`` and ``pack_factor``: that dimension stores ``pack_factor`` logical elements per
  stored element (e.g. eight 4-bit values per int32). Logical offsets along it are divided by
  ``pack_factor``.
- ``weight_loader``: the layer's loader, called as ``weight_loader(param, tensor[, shard_id])``.

Shard sizes are read off the parameter itself (it was created at its per-rank size), so packed
and grouped dimensions (a scale tensor with one row per quantization group) need no special case:
rank ``r`` of ``n`` takes the ``r``-th of ``n`` equal slices of the checkpoint tensor.
"""

from __future__ import annotations

from typing import Any

import torch


class ShardShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter shard it maps to."""


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any] | None) -> None:
    """Attach sharding facts (and a weight loader) to a parameter; refuses to overwrite one."""
    for key, value in (attrs or {}).items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def to_param_units(param: torch.Tensor, dim: int, logical: int) -> int:
    """Convert a logical size or offset along `dim` into stored elements of `param`."""
    if getattr(param, "packed_dim", None) != dim:
        return logical
    factor = param.pack_factor
    if logical % factor:
        raise ShardShapeError(
            f"offset/size {logical} along packed dim {dim} is not a multiple of the pack factor "
            f"{factor}: a shard boundary would split a packed element"
        )
    return logical // factor


def copy_shard(
    param: torch.Tensor,
    loaded: torch.Tensor,
    *,
    dim: int | None,
    index: int = 0,
    num_shards: int = 1,
    dest_offset: int = 0,
    dest_size: int | None = None,
) -> None:
    """Copy slice `index` of `num_shards` equal slices of `loaded` along `dim` into
    ``param[dest_offset : dest_offset + dest_size]`` along `dim` (sizes in stored units).

    `dim=None` copies the whole tensor. Every other dimension must match exactly.
    """
    target = param.data
    if loaded.is_floating_point() != target.is_floating_point():
        raise ShardShapeError(
            f"checkpoint dtype {loaded.dtype} cannot be loaded into a {target.dtype} parameter"
        )
    if dim is None:
        if tuple(loaded.shape) != tuple(target.shape):
            raise ShardShapeError(
                f"checkpoint shape {tuple(loaded.shape)} != parameter shape {tuple(target.shape)}"
            )
        target.copy_(loaded)
        return
    size = target.shape[dim] - dest_offset if dest_size is None else dest_size
    expected = list(target.shape)
    expected[dim] = size * num_shards
    if list(loaded.shape) != expected:
        raise ShardShapeError(
            f"checkpoint shape {tuple(loaded.shape)} does not fit: expected {tuple(expected)} "
            f"({num_shards} shard(s) of {size} along dim {dim}; parameter shard shape "
            f"{tuple(target.shape)})"
        )
    target.narrow(dim, dest_offset, size).copy_(loaded.narrow(dim, index * size, size))


def padded_shard_size(size: int, num_shards: int, align: int = 1) -> int:
    """Per-shard size of a dim of `size` elements split into `num_shards` equal shards of whole
    `align`-element blocks (a quantization block never straddles two ranks): the dim is padded
    up to ``num_shards * result``. MoE intermediate sizes use it (I=2880, 32-blocks: 1440 per rank
    at tp 2, 736 at tp 4, 384 at tp 8)."""
    blocks = -(-size // align)
    return -(-blocks // num_shards) * align


def copy_padded_shard(
    target: torch.Tensor, loaded: torch.Tensor, *, dim: int, index: int, full: int
) -> None:
    """Shard `index` of a dim padded to ``num_shards * S`` (S = ``target.shape[dim]``): copy
    elements ``[index * S, (index + 1) * S)`` of `loaded` that exist (`loaded` holds the `full`
    real elements along `dim`) and zero the rest of `target`. Sizes are in stored units."""
    if loaded.shape[dim] != full:
        raise ShardShapeError(
            f"checkpoint shape {tuple(loaded.shape)} has {loaded.shape[dim]} along dim {dim}, "
            f"expected {full} (parameter shard shape {tuple(target.shape)})"
        )
    size = target.shape[dim]
    start = index * size
    real = max(0, min(size, full - start))
    if real:
        copy_shard(target.narrow(dim, 0, real), loaded.narrow(dim, start, real), dim=None)
    target.narrow(dim, real, size - real).zero_()


def load_column_shard(
    param: torch.Tensor, loaded: torch.Tensor, tp_rank: int, tp_size: int
) -> None:
    """Shard along the output features (whole tensor if the parameter has no output_dim)."""
    dim = getattr(param, "output_dim", None)
    copy_shard(param, loaded, dim=dim, index=tp_rank, num_shards=tp_size if dim is not None else 1)


def load_row_shard(param: torch.Tensor, loaded: torch.Tensor, tp_rank: int, tp_size: int) -> None:
    """Shard along the input features (whole tensor if the parameter has no input_dim)."""
    dim = getattr(param, "input_dim", None)
    copy_shard(param, loaded, dim=dim, index=tp_rank, num_shards=tp_size if dim is not None else 1)


def load_output_slice(
    param: torch.Tensor,
    loaded: torch.Tensor,
    *,
    logical_offset: int,
    logical_size: int,
    index: int,
    num_shards: int,
    part: object = None,
) -> None:
    """Place one part of a fused output (a merged or q/k/v slice) at `logical_offset` of the
    parameter's output dim; offsets are in logical features and divided by the pack factor when
    that dim is packed. A parameter with no output_dim is shared by all parts (e.g. GPTQ g_idx of
    q/k/v, which read the same input): the first part loads it, the others must agree."""
    dim = getattr(param, "output_dim", None)
    if dim is None:
        load_shared_by_parts(param, loaded, part=part)
        return
    copy_shard(
        param,
        loaded,
        dim=dim,
        index=index,
        num_shards=num_shards,
        dest_offset=to_param_units(param, dim, logical_offset),
        dest_size=to_param_units(param, dim, logical_size),
    )


def load_shared_by_parts(param: torch.Tensor, loaded: torch.Tensor, *, part: object) -> None:
    """Load a tensor that every part of a fused layer carries; a part that disagrees is an error."""
    if not getattr(param, "_loaded_by_a_part", False):
        copy_shard(param, loaded, dim=None)
        param._loaded_by_a_part = True
        return
    if tuple(loaded.shape) != tuple(param.shape) or not torch.equal(
        loaded.to(device=param.device, dtype=param.dtype), param.data
    ):
        raise ShardShapeError(
            f"fused part {part!r} carries a different value than an earlier part of this "
            "parameter; parts that share an input must share it"
        )


def vocab_range(vocab_padded: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the padded vocabulary rows held by `tp_rank`."""
    per_rank = vocab_padded // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def load_vocab_shard(
    param: torch.Tensor, loaded: torch.Tensor, *, vocab_size: int, start: int
) -> None:
    """Copy rows [start, start + rows) of a [vocab, hidden] tensor into a padded vocab shard;
    rows past the real vocabulary are zero."""
    target = param.data
    if loaded.shape[0] != vocab_size or tuple(loaded.shape[1:]) != tuple(target.shape[1:]):
        raise ShardShapeError(
            f"checkpoint shape {tuple(loaded.shape)} does not fit: expected "
            f"({vocab_size}, {', '.join(map(str, target.shape[1:]))})"
        )
    real = max(0, min(target.shape[0], vocab_size - start))
    target[:real].copy_(loaded[start : start + real])
    target[real:].zero_()
