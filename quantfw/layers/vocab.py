"""Vocabulary-parallel embedding and LM head (vocab padded so every rank holds equal rows)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantfw import distributed as qdist
from quantfw.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    RuntimeKeeper,
    UnquantizedLinearMethod,
    create_layer_weights,
)
from quantfw.layers.sharding import copy_shard, load_vocab_shard, set_weight_attrs, vocab_range

DEFAULT_VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(RuntimeKeeper):
    """Rows of the (padded) vocabulary split across TP ranks; lookups outside a rank's rows give
    zeros there and the all-reduce fills them in."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING,
        prefix: str = "",
    ):
        super().__init__()
        self._init_shard(num_embeddings, embedding_dim, padding_size, prefix)
        self.weight = nn.Parameter(
            torch.empty(
                self.vocab_end - self.vocab_start,
                embedding_dim,
                dtype=params_dtype or torch.get_default_dtype(),
            ),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def _init_shard(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_size: int = DEFAULT_VOCAB_PADDING,
        prefix: str = "",
    ) -> None:
        self.prefix = prefix
        self.padding_size = padding_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = qdist.get_tp_rank()
        self.tp_size = qdist.get_tp_size()
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.vocab_start, self.vocab_end = vocab_range(
            self.num_embeddings_padded, self.tp_rank, self.tp_size
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """A tensor with vocabulary rows (``output_dim`` 0) takes this rank's rows, the padding
        rows zero; one without (a quantized head's codebook) is copied whole."""
        if getattr(param, "output_dim", None) is None:
            copy_shard(param, loaded, dim=None)
            return
        load_vocab_shard(param, loaded, vocab_size=self.num_embeddings, start=self.vocab_start)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return qdist.all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings} (padded {self.num_embeddings_padded}), "
            f"dim={self.embedding_dim}, rows={self.vocab_start}..{self.vocab_end}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocabulary; each rank computes its rows' logits, then they are
    gathered and the padding cut off.

    Its weight comes from a linear method, as a linear layer's does: the unquantized one, or
    the one `quant_config` returns for it (a method that quantizes the head, such as kbit with
    ``lm_head: true``; its tensors are ``lm_head.<name>``, vocabulary rows along dim 0)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        quant_config: QuantizationConfig | None = None,
        params_dtype: torch.dtype | None = None,
        **shard: Any,
    ):
        """`shard`: ``padding_size`` and ``prefix``, as `VocabParallelEmbedding` takes them."""
        nn.Module.__init__(self)
        self._init_shard(num_embeddings, embedding_dim, **shard)
        method = None
        if quant_config is not None:
            method = quant_config.get_quant_method(self, self.prefix)
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()
        self.input_size = embedding_dim
        self.output_size = num_embeddings  # the checkpoint tensor's rows
        self.register_parameter("bias", None)
        create_layer_weights(
            self,
            embedding_dim,
            [self.vocab_end - self.vocab_start],
            params_dtype or torch.get_default_dtype(),
            self.weight_loader,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden_states)
        logits = qdist.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)

    @classmethod
    def tied_to(
        cls,
        embedding: VocabParallelEmbedding,
        quant_config: QuantizationConfig | None = None,
        *,
        prefix: str = "lm_head",
    ) -> ParallelLMHead:
        """An LM head that shares `embedding`'s weight (tie_word_embeddings); a `quant_config`
        that would quantize the head is an error, as the embedding lookups need the dense rows."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head._init_shard(
            embedding.num_embeddings, embedding.embedding_dim, embedding.padding_size, prefix
        )
        method = quant_config.get_quant_method(head, prefix) if quant_config is not None else None
        if method is not None and not isinstance(method, UnquantizedLinearMethod):
            raise ValueError(
                f"layer {prefix}: {type(method).__name__} would quantize the LM head, but it is "
                f"tied to the input embedding (tie_word_embeddings=true), whose lookups need its "
                f"dense rows; quantize the head only in a model with an untied lm_head"
            )
        head.weight = embedding.weight
        head.quant_method = UnquantizedLinearMethod()
        return head
