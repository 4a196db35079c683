"""Where the tokens of one forward step live in the paged KV cache.

The cache is split into fixed-size blocks of `block_size` tokens. A sequence owns a block table
per KV-cache group (layers with the same attention span: full-attention layers form one group,
sliding-window layers another); entry ``i`` of a table is the block holding the sequence's
tokens ``[i * block_size, (i + 1) * block_size)``. Block 0 of every group is the null block: it
is never handed out, padded rows of CUDA-graph batches write there, and the table entries of a
sliding-window group that fell out of the window point at it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from quantfw.layers.attention.backends.base import AttentionBackend

#: The block id every group keeps free: padding writes and dropped window blocks point here.
NULL_BLOCK = 0


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once and shared by every layer.

    Tensors (model device, int32 unless noted): ``query_start_loc`` [B+1] offsets of each
    sequence's new tokens in the flat batch; ``context_lens`` [B] cached tokens of each sequence
    after this step (its new tokens are the last ``query_len`` of them); ``block_tables[g]``
    [B, >= max blocks] per KV-cache group; ``slot_mappings[g]`` [T] (int64) the flat cache row
    ``block * block_size + offset`` each new token is written to. Host ints: ``max_query_len``
    and ``max_context_len`` bound the batch (CUDA graphs pass the largest values they serve).
    """

    backend: AttentionBackend
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: list[torch.Tensor]
    slot_mappings: list[torch.Tensor]
    block_size: int
    max_query_len: int
    max_context_len: int
    #: per-step scratch a backend computes once and shares across layers (masks, plans, tiles)
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1
