"""Attention: one module (`Attention`), one backend interface (`AttentionBackend`), per-step
`AttentionMetadata` over a paged KV cache, and the backends: `SDPABackend` (reference, any
device), `TritonBackend` (CUDA), `FlashInferBackend` (CUDA, optional)."""

from quantfw.layers.attention.backends.base import AttentionBackend
from quantfw.layers.attention.backends.flashinfer import FlashInferBackend, flashinfer_available
from quantfw.layers.attention.backends.sdpa import SDPABackend
from quantfw.layers.attention.layer import Attention
from quantfw.layers.attention.metadata import NULL_BLOCK, AttentionMetadata
from quantfw.layers.attention.selector import BACKENDS, select_backend

__all__ = [
    "BACKENDS",
    "NULL_BLOCK",
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "FlashInferBackend",
    "SDPABackend",
    "flashinfer_available",
    "select_backend",
]
