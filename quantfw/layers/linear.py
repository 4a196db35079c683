"""Tensor-parallel linear layers. The quantization method owns the parameters and the math;
these layers own the sharding (through layers/sharding.py) and the collectives."""

from __future__ import annotations

import torch
from torch import nn

from quantfw import distributed as qdist
from quantfw.kernels.dense.ops import QkvRopeStore
from quantfw.layers import sharding
from quantfw.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    RuntimeKeeper,
    UnquantizedLinearMethod,
    create_layer_weights,
)


def divide(numerator: int, denominator: int, *, what: str, prefix: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"layer {prefix or '(root)'}: {what} {numerator} is not divisible by "
            f"tensor_parallel_size {denominator}"
        )
    return numerator // denominator


class LinearBase(RuntimeKeeper):
    """A linear layer whose parameters come from `quant_config.get_quant_method(self, prefix)`."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = qdist.get_tp_rank()
        self.tp_size = qdist.get_tp_size()
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()

    def _create(
        self, input_size_per_partition: int, output_partition_sizes: list[int], bias: bool
    ) -> None:
        create_layer_weights(
            self,
            input_size_per_partition,
            output_partition_sizes,
            self.params_dtype,
            self.weight_loader,
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=self.params_dtype),
                requires_grad=False,
            )
            sharding.set_weight_attrs(
                self.bias, {"output_dim": 0, "weight_loader": self.weight_loader}
            )
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
            f"method={type(self.quant_method).__name__}"
        )


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, **kw):
        super().__init__(input_size, output_size, **kw)
        self._create(input_size, [output_size], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        sharding.copy_shard(param, loaded, dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; `gather_output` concatenates them afterwards."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        output_sizes: list[int] | None = None,
        **kw,
    ):
        super().__init__(input_size, output_size, **kw)
        self.gather_output = gather_output
        sizes = output_sizes if output_sizes is not None else [output_size]
        self._create(input_size, self._partition_sizes(sizes), bias)

    def _partition_sizes(self, sizes: list[int]) -> list[int]:
        return [divide(s, self.tp_size, what="output size", prefix=self.prefix) for s in sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        sharding.load_column_shard(param, loaded, self.tp_rank, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return qdist.all_gather(out, dim=-1) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers fused along the output (e.g. gate_proj + up_proj). ``gated``:
    the two parts are the gate and up of a gated activation, which `forward_gated` applies
    (and a quantization method may fuse into its GEMM)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = True,
        gated: bool = False,
        **kw,
    ):
        self.output_sizes = list(output_sizes)
        if gated and (len(output_sizes) != 2 or output_sizes[0] != output_sizes[1]):
            raise ValueError(
                f"layer {kw.get('prefix', '')}: a gated pair has two equal output sizes "
                f"(gate, up), got {list(output_sizes)}"
            )
        self.gated = gated
        super().__init__(input_size, sum(output_sizes), bias=bias, output_sizes=output_sizes, **kw)
        if gated and self.gather_output:
            raise ValueError(f"layer {self.prefix}: a gated pair cannot gather its output")

    def forward_gated(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """``act(self(x))`` for a gated pair: [..., output_size / 2 per rank]."""
        if not self.gated:
            raise ValueError(f"layer {self.prefix}: forward_gated needs gated=True")
        return self.quant_method.apply_gated(self, x, self.bias, act)

    def _slices(self) -> list[tuple[int, int, int, int]]:
        """(logical offset in this rank's param, logical size, shard index, number of shards)
        for each fused part."""
        offsets = [sum(self.output_partition_sizes[:i]) for i in range(len(self.output_sizes))]
        return [
            (off, size, self.tp_rank, self.tp_size)
            for off, size in zip(offsets, self.output_partition_sizes)
        ]

    def _full_sizes(self) -> list[int]:
        return self.output_sizes

    def _shard_index(self, shard_id) -> int:
        return shard_id

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            self._load_fused(param, loaded)
            return
        slices = self._slices()
        index = self._shard_index(shard_id)
        if not isinstance(index, int) or not 0 <= index < len(slices):
            raise ValueError(f"layer {self.prefix}: unknown shard id {shard_id!r}")
        offset, size, shard_index, num_shards = slices[index]
        sharding.load_output_slice(
            param,
            loaded,
            logical_offset=offset,
            logical_size=size,
            index=shard_index,
            num_shards=num_shards,
            part=shard_id,
        )

    def _load_fused(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A checkpoint that already stores the fused tensor: split it into its parts."""
        dim = getattr(param, "output_dim", None)
        if dim is None:
            sharding.copy_shard(param, loaded, dim=None)
            return
        start = 0
        for index, full in enumerate(self._full_sizes()):
            units = sharding.to_param_units(param, dim, full)
            self.weight_loader(param, loaded.narrow(dim, start, units), self._shard_ids()[index])
            start += units
        if start != loaded.shape[dim]:
            raise sharding.ShardShapeError(
                f"fused checkpoint tensor of shape {tuple(loaded.shape)} has {loaded.shape[dim]} "
                f"along dim {dim}, expected {start}"
            )

    def _shard_ids(self) -> list:
        return list(range(len(self.output_sizes)))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection with grouped-query attention. When the TP size exceeds the number
    of kv heads, each kv head is replicated on tp_size / num_kv_heads consecutive ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        *,
        bias: bool = True,
        **kw,
    ):
        prefix = kw.get("prefix", "")
        tp = qdist.get_tp_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(
            total_num_heads, tp, what="number of attention heads", prefix=prefix
        )
        if tp >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(
                tp, total_num_kv_heads, what="(for kv-head replication) tp size", prefix=prefix
            )
        else:
            self.num_kv_heads = divide(
                total_num_kv_heads, tp, what="number of kv heads", prefix=prefix
            )
            self.num_kv_head_replicas = 1
        kv_size = total_num_kv_heads * head_size
        self._full = [total_num_heads * head_size, kv_size, kv_size]
        super().__init__(hidden_size, self._full, bias=bias, **kw)

    def _partition_sizes(self, sizes: list[int]) -> list[int]:
        kv = self.num_kv_heads * self.head_size
        return [self.num_heads * self.head_size, kv, kv]

    def _slices(self) -> list[tuple[int, int, int, int]]:
        q, kv, _ = self.output_partition_sizes
        kv_index = self.tp_rank // self.num_kv_head_replicas
        kv_shards = self.tp_size // self.num_kv_head_replicas
        return [
            (0, q, self.tp_rank, self.tp_size),
            (q, kv, kv_index, kv_shards),
            (q + kv, kv, kv_index, kv_shards),
        ]

    def _full_sizes(self) -> list[int]:
        return self._full

    def _shard_index(self, shard_id) -> int:
        return {"q": 0, "k": 1, "v": 2}.get(shard_id, -1)

    def _shard_ids(self) -> list:
        return ["q", "k", "v"]

    def forward_rope_store(self, x: torch.Tensor, store: QkvRopeStore) -> torch.Tensor | None:
        """One decode token's q/k/v projection with the rotary epilogue `store` (q and k rotated,
        k and v written to their cache row): this rank's rotated q, or None where the
        quantization method does not fuse it (then call the layer and rotate and store)."""
        return self.quant_method.apply_rope_store(self, x, self.bias, store)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed with all-reduce.
    The bias is added on TP rank 0 only, so the sum counts it once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        **kw,
    ):
        super().__init__(input_size, output_size, **kw)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        per_rank = divide(input_size, self.tp_size, what="input size", prefix=self.prefix)
        self._create(per_rank, [output_size], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        sharding.load_row_shard(param, loaded, self.tp_rank, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        bias = self.bias if self.tp_rank == 0 else None
        out = self.quant_method.apply(self, x, bias)
        return qdist.all_reduce(out) if self.reduce_results else out
