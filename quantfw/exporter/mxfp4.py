"""Round-to-nearest export into MXFP4 checkpoints in GPT-OSS's format (``quant_method:
mxfp4``): FP4 E2M1 codes with one UE8M0 scale per 32 inputs (`quantfw.kernels.mxfp4.quantize`).

* GPT-OSS experts ``mlp.experts.gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]`` (stored
  [in, out]) become ``<name>_blocks [E, out, in/32, 16]`` and ``<name>_scales [E, out, in/32]``,
  exactly as the released GPT-OSS checkpoints (transformers loads them).
* Linear layers (q/k/v/o/gate/up/down_proj, including one-tensor-per-expert MoE checkpoints
  such as Qwen3-MoE's ``experts.{e}.gate_proj.weight``) become ``<module>.weight_blocks`` and
  ``<module>.weight_scales``; with ``experts_only`` the dense (non-expert) ones keep their dtype.

Embeddings, norms, routers, lm_head and biases keep their dtype; ``modules_to_not_convert``
lists the linear modules left dense (layer indices written as ``*``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from quantfw.exporter.checkpoint import QUANTIZED_LINEARS
from quantfw.kernels import mxfp4

#: GPT-OSS's fused expert tensors, stored [E, in, out]
FUSED_EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def _is_expert(name: str) -> bool:
    return ".experts." in "." + name


class Mxfp4Exporter:
    def __init__(self, *, experts_only: bool):
        self.experts_only = experts_only
        self.kept_dense: set[str] = set()

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": "mxfp4", "modules_to_not_convert": sorted(self.kept_dense)}

    def _keep(self, module: str) -> None:
        self.kept_dense.add(re.sub(r"\.layers\.\d+\.", ".layers.*.", "." + module)[1:])

    @staticmethod
    def _quantize(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if weight.shape[-1] % mxfp4.BLOCK_SIZE:
            raise ValueError(
                f"cannot export {name!r} of shape {tuple(weight.shape)} as MXFP4: its input "
                f"features ({weight.shape[-1]}) must be a multiple of {mxfp4.BLOCK_SIZE} "
                "(use experts_only to keep dense layers as they are)"
            )
        return mxfp4.quantize(weight)

    def convert(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            prefix, _, leaf = name.rpartition(".")
            if leaf in FUSED_EXPERT_TENSORS and tensor.dim() == 3 and _is_expert(name + "."):
                blocks, scales = self._quantize(name, tensor.transpose(1, 2).contiguous())
                yield f"{name}_blocks", blocks
                yield f"{name}_scales", scales
            elif leaf == "weight" and tensor.dim() == 2:
                module = prefix.rpartition(".")[2]
                linear = module in QUANTIZED_LINEARS
                if linear and (_is_expert(prefix) or not self.experts_only):
                    blocks, scales = self._quantize(name, tensor)
                    yield f"{prefix}.weight_blocks", blocks
                    yield f"{prefix}.weight_scales", scales
                    continue
                self._keep(prefix)
                yield name, tensor
            else:
                yield name, tensor


_OPTIONS: dict[str, Any] = {"experts_only": False}


def build(method: str, args: dict[str, Any], hf_config: dict[str, Any]) -> Mxfp4Exporter:
    """The MXFP4 exporter for `args` (options: experts_only)."""
    unknown = sorted(set(args) - set(_OPTIONS))
    if unknown:
        raise ValueError(
            f"mxfp4 export: unknown option(s) {unknown}; supported: {sorted(_OPTIONS)}"
        )
    return Mxfp4Exporter(**{**_OPTIONS, **args})
