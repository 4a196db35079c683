"""The CUDA runtime layout of MXFP4 weights, read by the codebook-lookup mma kernel
(`quantfw.kernels.kbit.triton.mma`) and the Triton grouped GEMM.

A block's 16 bytes, read as 4 little-endian int32 words, are exactly kbit's K = 4 field-packed
block (word w: elements 8w .. 8w + 7 as nibbles, lowest first), so MXFP4 needs only kbit's
runtime arrangement, not a new one:

    qweight int32 [..., N_pad, G_pad * 4]   row n: its blocks in quads of 4 (kbit
                                            ``layout.QUAD``): word j of block 4q + r at
                                            16 q + 4 j + r
    scales  uint8 [..., N_pad, G_pad]       UE8M0, one per block

``N_pad`` rounds N up to 64 (the kernel's column blocks) and ``G_pad`` the blocks per row up
to 4 (a quad); padded rows and blocks are zero bytes (value 0). A quad's 64 bytes are one
contiguous row, so a tile of 128 inputs loads as the checkpoint's would, in a permuted input
order: byte ``64 q + 16 j + 4 r + b`` holds inputs ``128 q + 32 r + 8 j + 2 b`` (low nibble)
and ``+ 1`` (kbit's ``quad_k`` order for K = 4).
"""

from __future__ import annotations

import torch

from quantfw.kernels.kbit.layout import QUAD, block_words, interleave_quads
from quantfw.kernels.mxfp4.flashinfer_layout import round_up
from quantfw.kernels.mxfp4.format import BYTES_PER_BLOCK, check_blocks

PAD_N = 64


def pack(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint ``blocks [..., N, G, 16]`` / ``scales [..., N, G]`` -> the runtime
    ``(qweight, scales)`` above, on the tensors' device."""
    check_blocks(blocks, scales, "MXFP4 pack")
    *lead, n, groups, _ = blocks.shape
    n_pad, g_pad = round_up(n, PAD_N), round_up(groups, QUAD)
    padded = blocks.new_zeros(*lead, n_pad, g_pad, BYTES_PER_BLOCK)
    padded[..., :n, :groups, :] = blocks
    words = padded.view(torch.int32).reshape(-1, g_pad, 4)  # word j of each block
    qweight = interleave_quads(words).reshape(*lead, n_pad, g_pad * 4)
    s = scales.new_zeros(*lead, n_pad, g_pad)
    s[..., :n, :groups] = scales
    return qweight, s


def unpack(
    qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack` for a weight of N = n outputs and K = k inputs."""
    *lead, n_pad, words = qweight.shape
    per_block = block_words(qweight.reshape(-1, words), 4).contiguous()
    blocks = per_block.view(torch.uint8).reshape(*lead, n_pad, words // 4, BYTES_PER_BLOCK)
    groups = k // 32
    return blocks[..., :n, :groups, :].contiguous(), scales[..., :n, :groups].contiguous()
