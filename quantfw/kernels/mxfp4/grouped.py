"""The GPU entry points of grouped expert GEMMs (MXFP4 or dense weights), chosen per device;
no Triton import here (the kernels load on first CUDA use).

* `moe_forward`: a whole MoE layer on this rank: tokens sorted by expert (`kernels.moe.sort`),
  W13 grouped GEMM (+ bias), the activation, W2 grouped GEMM (+ bias), weighted combine. No
  host synchronisation, so decode steps can be captured in CUDA graphs.
* `linear`: a dense MXFP4 layer.

Weights are [E, N, K] (N outputs, K inputs): `DenseWeights` in the activation dtype, or
`Mxfp4Weights` in the runtime layout of `mxfp4.layout` (made once from the checkpoint's blocks
and scales by `Mxfp4Weights.pack`).

Kernels, picked by rows per expert (`triton.grouped_gemm.default_config`): up to 16 the
codebook-lookup mma kernel (`kbit/triton/mma.py`: E2M1 bytes from a shared-memory table into
``mma.sync`` fragments, the UE8M0 scale folded once per block); beyond, on sm_90 with bf16
activations, the wgmma kernel (`triton/wgmma.py`: the weights decoded into wgmma's register
operand, the activations in its k order); elsewhere the Triton grouped GEMM that decodes tiles
for ``tl.dot``, and from 64 rows the experts dequantized for the dense kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantfw.kernels.common import is_sm90, triton_available
from quantfw.kernels.fused import GatedAct
from quantfw.kernels.moe.sort import single_group
from quantfw.kernels.mxfp4 import layout


@dataclass
class DenseWeights:
    weight: torch.Tensor  # [E, N, K]

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.weight.shape
        return e, n, k


@dataclass
class Mxfp4Weights:
    """MXFP4 weights in the runtime layout (`mxfp4.layout`): ``qweight int32 [E, N_pad,
    G_pad * 4]``, ``scales uint8 [E, N_pad, G_pad]`` (no E for a dense layer) of a weight
    [E, n, k]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int

    @classmethod
    def pack(cls, blocks: torch.Tensor, scales: torch.Tensor) -> Mxfp4Weights:
        """From the checkpoint's ``blocks [(E,) N, K/32, 16]`` / ``scales [(E,) N, K/32]``."""
        qweight, s = layout.pack(blocks, scales)
        return cls(qweight, s, blocks.shape[-3], 32 * blocks.shape[-2])

    @property
    def shape(self) -> tuple[int, int, int]:
        e = self.qweight.shape[0] if self.qweight.dim() == 3 else 1
        return e, self.n, self.k

    def grouped(self) -> Mxfp4Weights:
        """A dense layer's weights as a group of one (made once: kernels keep per-weight state,
        such as TMA descriptors, on the object)."""
        if self.qweight.dim() == 3:
            return self
        group = self.__dict__.get("_group")
        if group is None:
            group = self.__dict__["_group"] = Mxfp4Weights(
                self.qweight.unsqueeze(0), self.scales.unsqueeze(0), self.n, self.k
            )
        return group


ExpertWeights = DenseWeights | Mxfp4Weights


def gpu_device(device: torch.device) -> bool:
    """Whether the Triton grouped GEMMs run on `device`: CUDA, compute capability >= 8.0,
    Triton installed."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0) and triton_available()


def gpu_available(x: torch.Tensor) -> bool:
    """Whether the Triton grouped GEMMs serve activations `x`: fp16/bf16 (fp32 runs
    full-precision dots, for checks) on a `gpu_device`."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return gpu_device(x.device)


def moe_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13: ExpertWeights,
    w2: ExpertWeights,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: Callable[..., torch.Tensor],
    config: dict | None = None,
    gate_up_interleave: int = 0,
) -> torch.Tensor:
    """``sum_j w[t, j] * (act(x[t] @ W13[e].T + b13[e]) @ W2[e].T + b2[e])`` for x [T, H] and
    the experts ``e = topk_ids[t, j]``; `config` overrides the kernel configuration (tuning).
    ``gate_up_interleave``: W13's rows (and bias) are interleaved in groups
    (`fused.interleave_gate_up`); the activation is a `layers.activation.GatedActivation`,
    which the lookup kernel computes in its epilogue where it can."""
    from quantfw.kernels.mxfp4.triton import grouped_gemm
    from quantfw.kernels.mxfp4.triton import sort as sort_kernels

    num_experts = w13.shape[0]
    rows = topk_ids.numel()
    mx = isinstance(w13, Mxfp4Weights)
    cfg = config or grouped_gemm.default_config(
        rows, num_experts, *w13.shape[1:], mxfp4=mx, dtype=x.dtype, hopper=is_sm90(x.device)
    )
    if cfg.get("DEQUANT") and mx:  # prefill: dense tensor-core GEMMs over dequantized experts
        w13, w2 = dequantize_dense(w13, x.dtype), dequantize_dense(w2, x.dtype)
    sort, plan = _sort(topk_ids, num_experts, cfg["BLOCK_M"])
    if cfg.get("WGMMA") and mx:  # prefill on sm_90: experts decoded into wgmma's A operand
        y = _experts_wgmma(
            x, sort, plan, w13, w2, w13_bias, w2_bias, activation, cfg, gate_up_interleave
        )
    else:
        if gate_up_interleave and cfg.get("LUT"):  # W13 -> activated rows in one launch
            act_cfg = {**cfg, "act": (activation.spec, gate_up_interleave)}
            a = grouped_gemm.grouped_gemm(
                x, w13, plan, bias=w13_bias, gather=sort.token_index, config=act_cfg
            )
        else:
            h = grouped_gemm.grouped_gemm(
                x, w13, plan, bias=w13_bias, gather=sort.token_index, config=cfg
            )
            a = _activate(activation, h, gate_up_interleave)
        y = grouped_gemm.grouped_gemm(a, w2, plan, bias=w2_bias, config=cfg)
    # one launch (the torch combine, a gather, a product and a sum, took 3x its time at prefill)
    return sort_kernels.combine(y, sort, topk_weights)


def _activate(activation: Callable[..., torch.Tensor], h: torch.Tensor, interleave: int):
    """The activation of W13's output (its gate and up rows interleaved in groups, if any)."""
    return activation(h, interleave) if interleave else activation(h)


def _sort(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The rows sorted by expert and their row blocks: one launch for decode-sized batches,
    three beyond (`triton.sort`)."""
    from quantfw.kernels.mxfp4.triton import sort as sort_kernels

    if sort_kernels.align_fits(topk_ids.numel(), num_experts):
        return sort_kernels.align(topk_ids, num_experts, block_m)
    return sort_kernels.sort_and_plan(topk_ids, num_experts, block_m)


def _experts_wgmma(
    x, sort, plan, w13, w2, w13_bias, w2_bias, activation, cfg, gate_up_interleave
) -> torch.Tensor:
    """The experts' rows (sorted) through the Hopper wgmma kernel (`triton.wgmma`): W13 reads
    the sorted rows gathered in its input order, W2 the activated rows written in it (by a
    `layers.activation.GatedActivation`; another activation's output is copied into it)."""
    from quantfw.kernels.mxfp4.triton import wgmma

    opts = wgmma.options(cfg)
    xs = wgmma.input_order(x.contiguous(), sort.token_index)
    h = wgmma.grouped_gemm(xs, w13, plan, bias=w13_bias, **opts)
    spec = getattr(activation, "spec", None)
    if isinstance(spec, GatedAct):  # written in W2's input order
        a = spec(h, gate_up_interleave, pairs_transposed=True)
    else:
        a = wgmma.input_order(_activate(activation, h, gate_up_interleave))
    return wgmma.grouped_gemm(a, w2, plan, bias=w2_bias, **opts)


def dequantize_dense(w: ExpertWeights, dtype: torch.dtype) -> DenseWeights:
    """`w` as `DenseWeights` in `dtype` (MXFP4 weights decoded on the GPU)."""
    if isinstance(w, DenseWeights):
        return w
    from quantfw.kernels.mxfp4.triton.dequantize import dequantize

    return DenseWeights(dequantize(w, dtype))


def linear(x: torch.Tensor, w: Mxfp4Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) for one MXFP4 matrix W [N, K] (a group of one)."""
    from quantfw.kernels.mxfp4.triton import grouped_gemm

    x2 = x.reshape(-1, x.shape[-1])
    weights = w.grouped()
    cfg = grouped_gemm.default_config(
        x2.shape[0], 1, w.n, w.k, dtype=x.dtype, hopper=is_sm90(x.device)
    )
    if cfg.get("DEQUANT"):
        d = dequantize_dense(weights, x.dtype).weight[0]
        return torch.nn.functional.linear(x, d, bias)
    if cfg.get("WGMMA"):
        from quantfw.kernels.mxfp4.triton import wgmma

        out = wgmma.dense_gemm(
            wgmma.input_order(x2.contiguous()), w.qweight, w.scales, w.n, wgmma.E2M1_DECODE,
            bias=bias, block_tokens=cfg["BLOCK_M"], owner=w, **wgmma.options(cfg),
        )  # fmt: skip
    else:
        plan = single_group(x2.shape[0], cfg["BLOCK_M"], x.device)
        b = None if bias is None else bias.unsqueeze(0)
        out = grouped_gemm.grouped_gemm(x2, weights, plan, bias=b, config=cfg)
    return out.view(*x.shape[:-1], w.n)
