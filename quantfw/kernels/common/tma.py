"""TMA descriptors of packed weight words (and scale words, read as int32): int32 rows copied
into shared memory as they are (no swizzle), the layout the lookup and wgmma kernels read them
in. A descriptor is kept on the object that owns the weight (built once: building descriptors
and layouts cost tens of microseconds of host time a call, which eager calls pay)."""

from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

#: the words' shared-memory layout
WORDS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def words_descriptor(
    words: torch.Tensor, box: list[int], owner: object | None = None
) -> TensorDescriptor:
    """The TMA descriptor of the 2-D int32 `words` in boxes of `box`, kept on `owner` (per
    address, shape and box) when given."""
    cache = owner.__dict__.setdefault("_tma_descriptors", {}) if owner is not None else {}
    key = (words.data_ptr(), tuple(words.shape), tuple(words.stride()), tuple(box))
    desc = cache.get(key)
    if desc is None:
        desc = cache[key] = TensorDescriptor.from_tensor(words, list(box), WORDS_LAYOUT)
    return desc
