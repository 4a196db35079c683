"""W4A16 (4-bit weight, 16-bit activation) kernels for AWQ and GPTQ checkpoints.

``layout`` (packed layout, repacking, CPU twin; no Triton), ``matmul`` (``w4a16_matmul``, the
per-call entry point), ``configs`` and ``tables`` (kernel configs: heuristics, tuned tables per
GPU model; no Triton), ``triton/`` (the GPU kernels, dispatch and tuning; imported only for
CUDA activations). Guide: docs/kernels-w4a16.md.
"""

from quantfw.kernels.w4a16.layout import *  # noqa: F403
from quantfw.kernels.w4a16.layout import __all__ as _layout_all
from quantfw.kernels.w4a16.matmul import w4a16_matmul

__all__ = [*_layout_all, "w4a16_matmul"]
