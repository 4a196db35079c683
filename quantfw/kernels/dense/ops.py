"""The entry point for unquantized linear layers and LM heads: the one-token GEMV
(`gemv.dense_gemv`, Triton) for a single fp16/bf16 token on a Hopper GPU, ``F.linear``
otherwise.

The GEMV reads its first weights before its programmatic-dependent-launch wait, so a weight
passed here must not be written by a kernel of the same stream launched with PDL (model
parameters are not). One token and several tokens take different kernels, so a sequence's
logits can differ in the last bits with the batch it decodes in (as with cuBLAS's own choice
of kernel by shape)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantfw.kernels.common import cuda_capability, triton_available

#: compute capabilities the GEMV serves: measured on Hopper (H100); other GPUs keep cuBLAS
CAPABILITIES = ((9, 0),)

#: weights of at least this many elements (an LM head, a large MLP projection) take two
#: rows and 1024 inputs a step; smaller ones four rows and 512 (H100, 2026-11-25:
#: `benchmarks/probe_dense_gemv.py`: on GPT-OSS-20B's and Qwen3-8B's shapes the fastest of
#: eight configs or within 9% of it, and 1.05-1.45x faster than cuBLAS, 2.8x on a router)
LARGE_WEIGHT = 1 << 26


def gemv_config(N: int, K: int) -> dict:
    """The `dense_gemv` options for a one-token ``[N, K]`` weight."""
    if N * K >= LARGE_WEIGHT:
        return dict(block_n=2, block_k=1024, ctas_per_sm=8, warps=4)
    return dict(block_n=4, block_k=512, ctas_per_sm=8, warps=2)


@dataclass(frozen=True)
class QkvRopeStore:
    """Where a one-token q/k/v projection's output goes when decode attention reads it
    directly (`dense_gemv`'s rotary epilogue): the weight's rows are ``num_heads`` q heads,
    ``num_kv_heads`` k heads and as many v heads of ``head_dim``; q and k are rotated by
    ``cos_sin`` ([1, head_dim] or [head_dim] float32: cos of the head_dim / 2 frequencies, then
    sin; rotate-half over the whole head, no per-head norm); k and v land in row ``slot`` ([1]
    int32 or int64) of ``k_cache`` / ``v_cache`` (contiguous, rows of ``num_kv_heads *
    head_dim``)."""

    cos_sin: torch.Tensor
    slot: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def problems(self, weight: torch.Tensor, block_n: int) -> list[str]:
        """What does not fit ``weight`` and ``block_n`` (empty: the epilogue can run)."""
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        problems = []
        if weight.shape[0] != q_rows + 2 * kv_rows:
            problems.append(
                f"weight {tuple(weight.shape)} is not {self.num_heads} + 2 x {self.num_kv_heads} "
                f"heads of {self.head_dim} rows"
            )
        if self.head_dim % 2 or block_n % 2 or (q_rows + kv_rows) % block_n:
            problems.append(f"head_dim {self.head_dim} and block_n {block_n} must pair rows")
        if self.cos_sin.numel() != self.head_dim or self.cos_sin.dtype != torch.float32:
            problems.append(f"cos_sin {tuple(self.cos_sin.shape)} {self.cos_sin.dtype}")
        if self.slot.numel() != 1 or self.slot.dtype not in (torch.int32, torch.int64):
            problems.append(f"slot {tuple(self.slot.shape)} {self.slot.dtype}")
        for name, cache in (("k_cache", self.k_cache), ("v_cache", self.v_cache)):
            if not cache.is_contiguous() or cache.shape[-2:].numel() != kv_rows:
                problems.append(f"{name} {tuple(cache.shape)} (contiguous rows of {kv_rows})")
        return problems

    def check(self, weight: torch.Tensor, block_n: int) -> None:
        """A ValueError naming every field that does not fit ``weight`` and ``block_n``."""
        problems = self.problems(weight, block_n)
        if problems:
            raise ValueError("dense_gemv rotary epilogue: " + "; ".join(problems))


def _gemv_serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `dense_gemv` takes this call: one fp16/bf16 token on a Hopper GPU."""
    return (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.numel() == x.shape[-1]
        and weight.dtype == x.dtype
        and weight.device == x.device
        and weight.numel() > 0
        and weight.stride(-1) == 1
        and (
            bias is None
            or (bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == weight.shape[:1])
        )
        and cuda_capability(x.device) in CAPABILITIES
        and triton_available()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for an unquantized weight, through `dense_gemv` (configured by
    `gemv_config`) for one fp16/bf16 token on a Hopper GPU."""
    if _gemv_serves(x, weight, bias):
        from quantfw.kernels.dense.gemv import dense_gemv

        cfg = gemv_config(*weight.shape)
        return dense_gemv(x.reshape(1, -1), weight, bias, **cfg).view(*x.shape[:-1], -1)
    return F.linear(x, weight, bias)


def linear_rope_store(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: QkvRopeStore
) -> torch.Tensor | None:
    """A one-token q/k/v projection with `store`'s rotary epilogue (`dense_gemv`): the rotated
    q ``[..., num_heads * head_dim]``, k and v written to their cache row; None where the GEMV
    does not take the call or its epilogue does not fit the shapes (the caller projects,
    rotates and stores as usual)."""
    if not _gemv_serves(x, weight, bias):
        return None
    cfg = gemv_config(*weight.shape)
    if store.problems(weight, cfg["block_n"]):
        return None
    from quantfw.kernels.dense.gemv import dense_gemv

    q = dense_gemv(x.reshape(1, -1), weight, bias, rope_store=store, **cfg)
    return q.view(*x.shape[:-1], -1)
