"""FlashInfer's paged prefill/decode wrappers (CUDA, fp16/bf16; ``pip install quantfw[flashinfer]``).

The block tables are FlashInfer's page tables (page size = block size): sequence b's pages are the
first ``ceil(context_lens[b] / block_size)`` entries of its row. One plan per KV-cache group and
step, made in `prepare` on the host (eager steps; decode graphs use the Triton backend).
Sliding windows map to ``window_left = window - 1``; attention sinks are not supported here.
"""

from __future__ import annotations

import torch

from quantfw.layers.attention.backends.base import AttentionBackend, write_kv
from quantfw.layers.attention.metadata import AttentionMetadata

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device, workspace_bytes: int = 128 * 1024 * 1024):
        import flashinfer

        self._flashinfer = flashinfer
        self._device = device
        self._workspace_bytes = workspace_bytes
        self._wrappers: dict[tuple[int, bool], object] = {}
        self.layer_shape: tuple[int, int, int, torch.dtype] | None = None
        self.group_windows: list[int | None] = [None]

    def configure(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        group_windows: list[int | None],
    ) -> None:
        """Shapes and each KV-cache group's sliding window (the engine calls this once)."""
        self.layer_shape = (num_heads, num_kv_heads, head_dim, dtype)
        self.group_windows = list(group_windows)

    def _wrapper(self, group: int, decode: bool):
        key = (group, decode)
        if key not in self._wrappers:
            fi = self._flashinfer
            workspace = torch.empty(self._workspace_bytes, dtype=torch.uint8, device=self._device)
            cls = (
                fi.BatchDecodeWithPagedKVCacheWrapper
                if decode
                else fi.BatchPrefillWithPagedKVCacheWrapper
            )
            self._wrappers[key] = cls(workspace, "NHD")
        return self._wrappers[key]

    def prepare(self, meta: AttentionMetadata) -> None:
        if self.layer_shape is None:
            raise RuntimeError("FlashInferBackend.configure() was not called before a step")
        num_heads, num_kv_heads, head_dim, dtype = self.layer_shape
        bs = meta.block_size
        ctx = meta.context_lens.to(torch.int32)
        pages = (ctx + bs - 1) // bs
        indptr = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=ctx.device)
        indptr[1:] = torch.cumsum(pages, 0)
        last_page_len = ctx - (pages - 1) * bs
        for group, window in enumerate(self.group_windows):
            table = meta.block_tables[group]
            cols = torch.arange(table.shape[1], device=table.device)
            indices = table[cols.view(1, -1) < pages.view(-1, 1)].to(torch.int32)
            common = dict(
                q_data_type=dtype,
                kv_data_type=dtype,
                window_left=-1 if window is None else window - 1,
            )
            if meta.is_decode:
                self._wrapper(group, True).plan(
                    indptr, indices, last_page_len, num_heads, num_kv_heads, head_dim, bs,
                    **common,
                )  # fmt: skip
            else:
                self._wrapper(group, False).plan(
                    meta.query_start_loc, indptr, indices, last_page_len, num_heads,
                    num_kv_heads, head_dim, bs, causal=True, **common,
                )  # fmt: skip
        meta.scratch["flashinfer_planned"] = True

    def forward(self, layer, q, k, v, meta, rope=None):
        if layer.sinks is not None:
            raise ValueError(
                f"layer {layer.prefix}: attention sinks are not supported by the flashinfer "
                "backend; use attention_backend='triton' or 'sdpa'"
            )
        q = write_kv(layer, q, k, v, meta, rope)
        if "flashinfer_planned" not in meta.scratch:
            self.prepare(meta)
        wrapper = self._wrapper(layer.kv_group, meta.is_decode)
        out = wrapper.run(q.contiguous(), layer.kv_cache)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)
