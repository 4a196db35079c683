"""Vocabulary-parallel embedding and LM head (vocab padded so every rank holds equal rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantfw import distributed as qdist
from quantfw.kernels.dense import ops as dense_ops
from quantfw.layers.sharding import load_vocab_shard, set_weight_attrs, vocab_range

DEFAULT_VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
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
        self.prefix = prefix
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = qdist.get_tp_rank()
        self.tp_size = qdist.get_tp_size()
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.vocab_start, self.vocab_end = vocab_range(
            self.num_embeddings_padded, self.tp_rank, self.tp_size
        )
        self.weight = nn.Parameter(
            torch.empty(
                self.vocab_end - self.vocab_start,
                embedding_dim,
                dtype=params_dtype or torch.get_default_dtype(),
            ),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
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
    gathered and the padding cut off."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = dense_ops.linear(hidden_states, self.weight)
        logits = qdist.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)

    @classmethod
    def tied_to(cls, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        """An LM head that shares `embedding`'s weight (tie_word_embeddings)."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        for key in (
            "prefix",
            "num_embeddings",
            "embedding_dim",
            "tp_rank",
            "tp_size",
            "num_embeddings_padded",
            "vocab_start",
            "vocab_end",
        ):
            setattr(head, key, getattr(embedding, key))
        head.weight = embedding.weight
        return head
