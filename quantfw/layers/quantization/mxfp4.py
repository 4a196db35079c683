"""MXFP4 (``quant_method: mxfp4``): FP4 E2M1 weights with one UE8M0 scale per 32 inputs, as
GPT-OSS checkpoints store their experts (format: `quantfw.kernels.mxfp4.format`,
docs/formats.md).

* Experts (`FusedMoE`): ``<experts>.gate_up_proj_blocks [E, 2I, H/32, 16]`` (gate and up rows
  interleaved), ``gate_up_proj_scales [E, 2I, H/32]``, ``down_proj_blocks [E, H, I/32, 16]``,
  ``down_proj_scales [E, H, I/32]`` (uint8), biases in the model dtype; or one tensor per expert
  (``experts.{e}.gate_proj.weight_blocks``...). The model's expert mapping says which.
* Dense linear layers: ``weight_blocks [O, I/32, 16]`` and ``weight_scales [O, I/32]``
  (quantfw's own naming, written by ``quantfw quantize --method mxfp4``; GPT-OSS keeps its dense
  layers in bf16 and lists them in ``modules_to_not_convert``).

Runtime: on Blackwell with FlashInfer installed, experts go through FlashInfer's MXFP8 x MXFP4
grouped GEMM (`quantfw.kernels.mxfp4.flashinfer`; scales swizzled once after loading; not
run on hardware by this project yet); on Hopper with ``moe_backend: "flashinfer"`` (opt-in,
bf16) through FlashInfer's CUTLASS fused MoE (`quantfw.kernels.mxfp4.flashinfer_sm90`); on
other CUDA GPUs (compute capability >= 8.0, Triton
installed) the weights are repacked once after loading (`quantfw.kernels.mxfp4.layout`) for
our grouped kernels (`quantfw.kernels.mxfp4.grouped`; a dense layer is a group of one);
elsewhere one expert (or layer) at a time is dequantized for a plain matmul and freed after
it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantfw.kernels import fused, kbit, moe, mxfp4
from quantfw.kernels.mxfp4 import grouped
from quantfw.layers.activation import GatedActivation
from quantfw.layers.moe.base import FusedMoEMethodBase, create_expert_biases, moe_param
from quantfw.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedLinearMethod,
    check_divisible,
    kept_runtime,
    replace_with_buffers,
)
from quantfw.layers.sharding import set_weight_attrs

#: UE8M0 bytes a dummy model draws: 2**-9 .. 2**-6 per scale, weights of at most 6 * 2**-6
DUMMY_SCALE_RANGE = (118, 122)


def _dummy_scales(param: torch.Tensor, generator: torch.Generator) -> None:
    low, high = DUMMY_SCALE_RANGE
    values = torch.randint(
        low, high, param.shape, generator=generator, dtype=torch.int64, device=generator.device
    )
    param.data.copy_(values.to(param.dtype))


class Mxfp4Config(QuantizationConfig):
    """``quant_method: mxfp4``; reads ``modules_to_not_convert`` (names, or regexes with ``*``
    such as GPT-OSS's ``model.layers.*.self_attn``). Experts and dense linear layers not listed
    there are MXFP4; routers are always built unquantized by the models."""

    #: ``moe_backend`` values: "auto" (FlashInfer on Blackwell when installed, else our
    #: kernels), "triton" (our kernels), "flashinfer" (FlashInfer on SM90 or SM100+, or an error)
    MOE_BACKENDS = ("auto", "triton", "flashinfer")

    def __init__(
        self, *, modules_to_not_convert: list[str] | None = None, moe_backend: str = "auto"
    ):
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        if moe_backend not in self.MOE_BACKENDS:
            raise ValueError(
                f"mxfp4: moe_backend={moe_backend!r}; supported: {', '.join(self.MOE_BACKENDS)}"
            )
        self.moe_backend = moe_backend

    @classmethod
    def get_name(cls) -> str:
        return "mxfp4"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Mxfp4Config:
        return cls(
            modules_to_not_convert=config.get("modules_to_not_convert"),
            moe_backend=config.get("moe_backend", "auto"),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from quantfw.layers.linear import LinearBase
        from quantfw.layers.moe import FusedMoE, UnquantizedFusedMoEMethod

        if isinstance(layer, FusedMoE):
            return (
                UnquantizedFusedMoEMethod()
                if self.is_layer_skipped(prefix)
                else Mxfp4MoEMethod(self.moe_backend, prefix)
            )
        if isinstance(layer, LinearBase):
            return (
                UnquantizedLinearMethod() if self.is_layer_skipped(prefix) else Mxfp4LinearMethod()
            )
        return None

    def __repr__(self) -> str:
        return (
            f"Mxfp4Config(modules_to_not_convert={self.modules_to_not_convert}, "
            f"moe_backend={self.moe_backend!r})"
        )


def _check_blocks(layer: nn.Module, what: str, size: int) -> None:
    check_divisible(
        layer, what, size, mxfp4.BLOCK_SIZE, "MXFP4 shares one scale per 32 inputs and a shard "
        "(or the checkpoint's block layout) would split a block"
    )  # fmt: skip


class Mxfp4LinearMethod(LinearMethodBase):
    """``weight_blocks [O, I/32, 16]`` and ``weight_scales [O, I/32]`` (uint8)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        _check_blocks(layer, "input size per partition", input_size_per_partition)
        out, groups = sum(output_partition_sizes), input_size_per_partition // mxfp4.BLOCK_SIZE
        attrs = {"input_dim": 1, "output_dim": 0, "packed_dim": 1, "pack_factor": mxfp4.BLOCK_SIZE}
        for name, shape, more in (
            ("weight_blocks", (out, groups, mxfp4.BLOCK_SIZE // 2), {}),
            ("weight_scales", (out, groups), {"dummy_init": _dummy_scales}),
        ):
            param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
            set_weight_attrs(param, {**attrs, **more, **extra})
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On a GPU the Triton kernels serve: repack into their runtime layout once
        (`mxfp4.layout`; buffers ``weight_qweight``, ``weight_qscales``)."""
        _pack_for_gpu(layer, "weight")

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed = _packed(layer, "weight")
        if packed is not None:
            return grouped.linear(x, packed, bias)
        weight = mxfp4.dequantize(layer.weight_blocks, layer.weight_scales, x.dtype)
        return F.linear(x, weight, bias)

    def runtime_nbytes(self, layer: nn.Module) -> int:
        packed = _packed(layer, "weight")
        if packed is not None:
            return packed.qweight.nbytes + packed.scales.nbytes
        return layer.weight_blocks.numel() + layer.weight_scales.numel()


def _pack_for_gpu(layer: nn.Module, name: str, gate_up_interleave: int = 0) -> None:
    """Replace ``<name>_blocks`` / ``<name>_scales`` of a layer on a GPU that the Triton kernels
    serve by the runtime layout (buffers ``<name>_qweight``, ``<name>_qscales``);
    ``gate_up_interleave``: W13's rows and bias interleaved in groups of that many
    (`fused.interleave_gate_up`), which lets the lookup kernel activate them in its epilogue."""
    blocks = getattr(layer, f"{name}_blocks")
    if not grouped.gpu_device(blocks.device):
        return
    scales = getattr(layer, f"{name}_scales").data
    blocks = blocks.data
    if gate_up_interleave:
        blocks = fused.interleave_gate_up(blocks, gate_up_interleave, dim=1)
        scales = fused.interleave_gate_up(scales, gate_up_interleave, dim=1)
        bias = getattr(layer, f"{name}_bias", None)
        if bias is not None:
            bias.data = fused.interleave_gate_up(bias.data, gate_up_interleave, dim=1)
        layer.gate_up_interleave = gate_up_interleave
    packed = grouped.Mxfp4Weights.pack(blocks, scales)
    replace_with_buffers(
        layer,
        (f"{name}_blocks", f"{name}_scales"),
        {f"{name}_qweight": packed.qweight, f"{name}_qscales": packed.scales},
    )
    setattr(layer, f"{name}_mxfp4_size", (packed.n, packed.k))


def _packed(layer: nn.Module, name: str) -> grouped.Mxfp4Weights | None:
    """The runtime-layout weights `_pack_for_gpu` made (one `Mxfp4Weights`, `kept_runtime`), or
    None."""
    qweight = getattr(layer, f"{name}_qweight", None)
    if qweight is None:
        return None
    return kept_runtime(
        layer, name, qweight,
        lambda: grouped.Mxfp4Weights(
            qweight, getattr(layer, f"{name}_qscales"), *getattr(layer, f"{name}_mxfp4_size")
        ),
    )  # fmt: skip


class Mxfp4MoEMethod(FusedMoEMethodBase):
    """``w13_blocks [E, 2 I_p, H/32, 16]``, ``w13_scales [E, 2 I_p, H/32]``, ``w2_blocks
    [E, H, I_p/32, 16]``, ``w2_scales [E, H, I_p/32]`` (uint8), with biases when the layer has
    them. ``I_p`` is padded to whole 32-blocks per rank; padded rows and blocks are zero."""

    intermediate_alignment = mxfp4.BLOCK_SIZE

    def __init__(self, backend: str = "auto", prefix: str = ""):
        self.backend = backend
        self.prefix = prefix

    def create_weights(  # type: ignore[override]
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        _check_blocks(layer, "hidden size", hidden_size)
        _check_blocks(layer, "intermediate size", layer.intermediate_size)
        e, h, i, b = num_experts, hidden_size, intermediate_size_per_partition, mxfp4.BLOCK_SIZE
        u8 = torch.uint8
        scales = {"dummy_init": _dummy_scales}
        moe_param(
            layer,
            "w13_blocks",
            torch.empty(e, 2 * i, h // b, b // 2, dtype=u8),
            moe_dim=1,
            fused=True,
            **extra,
        )
        moe_param(
            layer,
            "w13_scales",
            torch.empty(e, 2 * i, h // b, dtype=u8),
            moe_dim=1,
            fused=True,
            **scales,
            **extra,
        )
        moe_param(
            layer,
            "w2_blocks",
            torch.empty(e, h, i // b, b // 2, dtype=u8),
            moe_dim=2,
            fused=False,
            units=b,
            **extra,
        )
        moe_param(
            layer,
            "w2_scales",
            torch.empty(e, h, i // b, dtype=u8),
            moe_dim=2,
            fused=False,
            units=b,
            **scales,
            **extra,
        )
        if layer.has_bias:
            create_expert_biases(layer, e, h, i, params_dtype, **extra)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack the experts once for the backend `_backend` picks: FlashInfer on Blackwell
        (padded, scales swizzled: buffers ``w13_fi_*``/``w2_fi_*``), FlashInfer on SM90
        (`flashinfer_sm90`: [up | gate], padded to 128, interleaved: buffers ``fi90_*``; GEMM
        tactics picked by timing, `flashinfer_sm90.pick_tactics`), or our
        Triton kernels (`mxfp4.layout`: buffers ``w13_qweight``, ``w13_qscales``, ``w2_*``).
        On the CPU the checkpoint layout is what the per-expert path reads."""
        backend = self._backend(layer)
        if backend == "flashinfer_sm90":
            from quantfw.kernels.mxfp4 import flashinfer_sm90

            w13_bias, w2_bias = layer.expert_biases()
            padded = flashinfer_sm90.pad_experts(
                layer.w13_blocks.data, layer.w13_scales.data,
                layer.w2_blocks.data, layer.w2_scales.data, w13_bias, w2_bias,
            )  # fmt: skip
            experts = flashinfer_sm90.Sm90Experts.prepare(padded, layer.activation.spec)
            tactics = flashinfer_sm90.pick_tactics(experts, layer.top_k)
            replace_with_buffers(
                layer,
                ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"),
                {f"fi90_{name}": t for name, t in experts.tensors().items()},
            )
            layer.fi90_hidden_size = experts.hidden_size
            layer.fi90_tactics = tactics
            return
        if backend == "triton":
            gated = isinstance(layer.activation, GatedActivation)
            _pack_for_gpu(layer, "w13", kbit.GATED_GROUP if gated else 0)
            _pack_for_gpu(layer, "w2")
            return
        from quantfw.kernels.mxfp4 import flashinfer

        w13 = flashinfer.FlashInferWeights.prepare(layer.w13_blocks.data, layer.w13_scales.data)
        w2 = flashinfer.FlashInferWeights.prepare(layer.w2_blocks.data, layer.w2_scales.data)
        replace_with_buffers(
            layer,
            ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"),
            {
                "w13_fi_b": w13.b,
                "w13_fi_scale": w13.b_scale,
                "w2_fi_b": w2.b,
                "w2_fi_scale": w2.b_scale,
            },
        )
        layer.flashinfer_sizes = ((w13.n, w13.k), (w2.n, w2.k))

    def _backend(self, layer: nn.Module) -> str:
        """The path for this layer's device, dtype and `backend` choice: "flashinfer_sm100",
        "flashinfer_sm90" or "triton" (which is the per-expert path off CUDA)."""
        from quantfw.kernels.mxfp4 import flashinfer, flashinfer_sm90

        device, dtype = layer.w13_blocks.device, layer.params_dtype
        fp16 = dtype in (torch.float16, torch.bfloat16)
        if self.backend == "triton":
            return "triton"
        if self.backend == "auto":
            return "flashinfer_sm100" if fp16 and flashinfer.available(device) else "triton"
        if fp16 and flashinfer.available(device):
            return "flashinfer_sm100"
        if dtype == torch.bfloat16 and flashinfer_sm90.available(device):
            return "flashinfer_sm90"
        raise ValueError(
            f"{self.prefix}: mxfp4 moe_backend='flashinfer' needs FlashInfer installed and "
            "either an SM90 GPU with bfloat16 activations (its CUTLASS fused MoE) or an SM100+ "
            f"GPU with float16/bfloat16 (its MXFP4 grouped GEMM); this layer is {dtype} on "
            f"{device}. Use moe_backend 'auto' or 'triton' for quantfw's own kernels."
        )

    def apply(  # type: ignore[override]
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if getattr(layer, "fi90_hidden_size", None) is not None:
            from quantfw.kernels.mxfp4 import flashinfer_sm90

            experts = kept_runtime(
                layer, "fi90", layer.fi90_w13,
                lambda: flashinfer_sm90.Sm90Experts.from_layer(layer, "fi90_"),
            )  # fmt: skip
            tactics = flashinfer_sm90.tactics_for(layer.fi90_tactics, x.shape[0])
            return flashinfer_sm90.moe_forward(x, topk_weights, topk_ids, experts, tactics)
        w13_bias, w2_bias = layer.expert_biases()
        if getattr(layer, "w13_fi_b", None) is not None:
            from quantfw.kernels.mxfp4 import flashinfer

            (n13, k13), (n2, k2) = layer.flashinfer_sizes
            return flashinfer.moe_forward(
                x, topk_weights, topk_ids,
                w13=flashinfer.FlashInferWeights(layer.w13_fi_b, layer.w13_fi_scale, n13, k13),
                w2=flashinfer.FlashInferWeights(layer.w2_fi_b, layer.w2_fi_scale, n2, k2),
                w13_bias=w13_bias, w2_bias=w2_bias, activation=layer.activation,
            )  # fmt: skip
        w13, w2 = _packed(layer, "w13"), _packed(layer, "w2")
        if w13 is not None and w2 is not None:
            return grouped.moe_forward(
                x, topk_weights, topk_ids, w13=w13, w2=w2,
                w13_bias=w13_bias, w2_bias=w2_bias, activation=layer.activation,
                gate_up_interleave=getattr(layer, "gate_up_interleave", 0),
            )  # fmt: skip

        def expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                mxfp4.dequantize(layer.w13_blocks[e], layer.w13_scales[e], x.dtype),
                mxfp4.dequantize(layer.w2_blocks[e], layer.w2_scales[e], x.dtype),
            )

        return moe.experts_forward_cpu(
            x, topk_weights, topk_ids, num_experts=layer.num_experts,
            expert_weights=expert_weights, activation=layer.activation,
            w13_bias=w13_bias, w2_bias=w2_bias,
        )  # fmt: skip
