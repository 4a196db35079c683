"""Export into the kbit format (docs/formats.md): each decoder linear weight ``[O, I]`` becomes
``kbit_planes int32 [O, I/32, K]``, ``kbit_absmax uint8 [O, I/32]`` (E4M4) and
``kbit_codebook float32 [2**K]``; embeddings and norms keep their dtype, and so does lm_head
unless ``lm_head=True`` (an untied head only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from quantfw.exporter.checkpoint import quantize_linears
from quantfw.kernels.kbit import format as kfmt

#: the options kbit export takes, with their defaults
OPTIONS: dict[str, Any] = {"bits": 4, "blocksize": kfmt.BLOCKSIZE, "lm_head": False}


class KbitExporter:
    def __init__(self, *, bits: int, blocksize: int, lm_head: bool = False):
        self.bits = kfmt.check_bits(bits, "kbit export")
        self.blocksize = kfmt.check_blocksize(blocksize, "kbit export")
        if not isinstance(lm_head, bool):
            raise ValueError(f"kbit export: lm_head={lm_head!r}; use True or False")
        self.lm_head = lm_head
        self.codebook = kfmt.normal_float_codebook(bits)

    def quantization_config(self) -> dict[str, Any]:
        from quantfw import __version__

        return {
            "quant_method": "kbit",
            "bits": self.bits,
            "blocksize": self.blocksize,
            "codebook": "normal_float",
            "absmax_format": "e4m4",
            "lm_head": self.lm_head,
            "modules_to_not_convert": None,
            "quantizer": f"quantfw:{__version__}",
        }

    def quantize_linear(
        self, prefix: str, weight: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        planes, absmax = kfmt.quantize(weight, self.bits, self.codebook, name=f"{prefix}.weight")
        yield f"{prefix}.kbit_planes", planes
        yield f"{prefix}.kbit_absmax", absmax
        yield f"{prefix}.kbit_codebook", self.codebook.clone()

    def convert(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        also = ("lm_head",) if self.lm_head else ()
        return quantize_linears(tensors, self.quantize_linear, also=also)


def build(method: str, args: dict[str, Any], hf_config: dict[str, Any]) -> KbitExporter:
    """The kbit exporter for `args` (``bits``, ``blocksize``, ``lm_head``; unknown options are an
    error, as is ``lm_head`` for a model whose head is tied to its input embedding)."""
    unknown = sorted(set(args) - set(OPTIONS))
    if unknown:
        raise ValueError(f"kbit export: unknown option(s) {unknown}; supported: {sorted(OPTIONS)}")
    exporter = KbitExporter(**{**OPTIONS, **args})
    if exporter.lm_head and hf_config.get("tie_word_embeddings", False):
        raise ValueError(
            "kbit export: lm_head=True, but the model ties lm_head to the input embedding "
            "(tie_word_embeddings=true), whose lookups need its dense rows"
        )
    return exporter
