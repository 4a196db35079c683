"""The FusedMoE layer: router top-k, the experts' grouped GEMMs through its quantize method,
the weighted combine, and one all-reduce under tensor parallelism.

Tensor parallelism shards every expert's intermediate dim: rank r holds features
``[r * I_p, (r + 1) * I_p)`` of gate, up and down's input, where ``I_p`` is the intermediate
size split into equal shards of whole quantization blocks (`sharding.padded_shard_size`), the
padding zero-filled. Each rank computes a partial sum of the experts' outputs; one all-reduce
after the combine adds them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantfw import distributed as qdist
from quantfw.kernels.moe import SCORING_FUNCTIONS, select_experts
from quantfw.layers import sharding
from quantfw.layers.activation import SiluAndMul
from quantfw.layers.moe.base import W2_PARTS, W13_PARTS, ExpertShard, FusedMoEMethodBase
from quantfw.layers.moe.unquantized import UnquantizedFusedMoEMethod
from quantfw.layers.quantization.base import QuantizationConfig, RuntimeKeeper


class FusedMoE(RuntimeKeeper):
    """`num_experts` gated MLPs (W13 = [gate | up], W2 = down, optional biases), `top_k` per
    token. ``forward(hidden [..., H], router_logits [..., E]) -> [..., H]``.

    `scoring` is one of `SCORING_FUNCTIONS` (with `renormalize`, Qwen3's ``norm_topk_prob``);
    `activation` maps [.., 2I] (gate then up) to [.., I] (default SiLU-and-mul)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: nn.Module | None = None,
        bias: bool = False,
        scoring: str = "softmax_topk",
        renormalize: bool = False,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        if scoring not in SCORING_FUNCTIONS:
            raise ValueError(
                f"layer {prefix or '(root)'}: unknown MoE scoring {scoring!r}; supported: "
                f"{list(SCORING_FUNCTIONS)}"
            )
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"layer {prefix or '(root)'}: top_k={top_k} must be in 1..num_experts={num_experts}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.has_bias = bias
        self.scoring = scoring
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self.tp_rank = qdist.get_tp_rank()
        self.tp_size = qdist.get_tp_size()
        self.activation = activation if activation is not None else SiluAndMul()
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        if (
            method is None
            and quant_config is not None
            and not quant_config.is_layer_skipped(prefix)
        ):
            raise ValueError(
                f"layer {prefix or '(root)'}: quantization method {quant_config.get_name()!r} has "
                "no method for mixture-of-experts layers; supported: mxfp4, or unquantized experts "
                "(list the layer in modules_to_not_convert)"
            )
        self.quant_method: FusedMoEMethodBase = method or UnquantizedFusedMoEMethod()
        if not isinstance(self.quant_method, FusedMoEMethodBase):
            raise TypeError(
                f"layer {prefix}: {type(self.quant_method).__name__} is not a FusedMoEMethodBase"
            )
        self.intermediate_size_per_partition = sharding.padded_shard_size(
            intermediate_size, self.tp_size, self.quant_method.intermediate_alignment
        )
        self.quant_method.create_weights(
            self,
            num_experts,
            hidden_size,
            self.intermediate_size_per_partition,
            self.params_dtype,
            weight_loader=self.weight_loader,
        )

    def expert_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(w13_bias, w2_bias) as this rank adds them: w2_bias on TP rank 0 only."""
        if not self.has_bias:
            return None, None
        return self.w13_bias, self.w2_bias if self.tp_rank == 0 else None

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, self.hidden_size)
        logits = router_logits.reshape(-1, self.num_experts)
        topk_weights, topk_ids = select_experts(logits, self.top_k, self.scoring, self.renormalize)
        out = self.quant_method.apply(self, x, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = qdist.all_reduce(out)
        return out.view(hidden.shape)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: ExpertShard | None = None
    ) -> None:
        """Load a checkpoint tensor described by `shard` (see `ExpertShard`). Without a shard
        the tensor holds every expert in this parameter's own TP=1 layout ([gate | up] halves
        for the W13 side)."""
        fused = param.moe_fused
        if shard is None:
            part, expert = ("halves" if fused else "w2"), None
        else:
            part, expert = shard.part, shard.expert_id
            allowed = W13_PARTS if fused else W2_PARTS
            if part not in allowed:
                raise ValueError(
                    f"layer {self.prefix}: part {part!r} cannot load a "
                    f"{'gate/up' if fused else 'down'} parameter; expected one of {list(allowed)}"
                )
            if shard.transposed:
                loaded = loaded.transpose(-1, -2)
        dim = param.moe_dim
        if expert is None:
            if loaded.dim() == 0 or loaded.shape[0] != self.num_experts:
                raise sharding.ShardShapeError(
                    f"checkpoint shape {tuple(loaded.shape)} should hold all "
                    f"{self.num_experts} experts along dim 0"
                )
            target = param.data
        else:
            if not 0 <= expert < self.num_experts:
                raise ValueError(
                    f"layer {self.prefix}: expert {expert} out of range (num_experts "
                    f"{self.num_experts})"
                )
            target = param.data[expert]
            dim = None if dim is None else dim - 1
        if dim is None:
            sharding.copy_shard(target, loaded, dim=None)
            return
        full = self.intermediate_size // param.moe_units
        if not fused:
            sharding.copy_padded_shard(target, loaded, dim=dim, index=self.tp_rank, full=full)
            return
        for half, piece in self._gate_up_pieces(part, loaded, dim, full):
            size = target.shape[dim] // 2
            sharding.copy_padded_shard(
                target.narrow(dim, half * size, size), piece, dim=dim, index=self.tp_rank, full=full
            )

    @staticmethod
    def _gate_up_pieces(
        part: str, loaded: torch.Tensor, dim: int, full: int
    ) -> list[tuple[int, torch.Tensor]]:
        """(half, tensor) pairs: half 0 is gate, 1 is up."""
        if part == "w1":
            return [(0, loaded)]
        if part == "w3":
            return [(1, loaded)]
        if loaded.shape[dim] != 2 * full:
            raise sharding.ShardShapeError(
                f"fused gate/up checkpoint shape {tuple(loaded.shape)} should have {2 * full} "
                f"along dim {dim}"
            )
        if part == "w13":  # interleaved rows
            pairs = loaded.unflatten(dim, (full, 2))
            return [(0, pairs.select(dim + 1, 0)), (1, pairs.select(dim + 1, 1))]
        return [(0, loaded.narrow(dim, 0, full)), (1, loaded.narrow(dim, full, full))]

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size} ({self.intermediate_size_per_partition} per "
            f"rank), tp={self.tp_size}, scoring={self.scoring}, bias={self.has_bias}, "
            f"method={type(self.quant_method).__name__}"
        )


def expert_params_mapping(
    num_experts: int,
    *,
    gate: str = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    experts: str = "experts",
) -> list[tuple[str, str, Any]]:
    """Mapping entries (parameter part, checkpoint part, ExpertShard) for checkpoints that store
    one tensor per expert and projection (``experts.{e}.gate_proj.weight``; MXFP4 exports add
    ``weight_blocks``/``weight_scales``). Put them before the stacked entries: a dense MLP's
    ``gate_proj`` entry would also match an expert's name."""
    suffixes = {
        "weight": "weight",
        "weight_blocks": "blocks",
        "weight_scales": "scales",
        "bias": "bias",
    }
    mapping = []
    for e in range(num_experts):
        for ckpt, part in ((gate, "w1"), (up, "w3"), (down, "w2")):
            side = "w2" if part == "w2" else "w13"
            for suffix, param_suffix in suffixes.items():
                mapping.append(
                    (
                        f"{experts}.{side}_{param_suffix}",
                        f"{experts}.{e}.{ckpt}.{suffix}",
                        ExpertShard(e, part),
                    )
                )
    return mapping
