"""Ahead-of-time sm_90 compiles of the 4-bit wgmma kernel (`mxfp4.triton.wgmma`), shared by the
MXFP4 and kbit tests: no GPU needed."""

from __future__ import annotations

from typing import Any

import torch


def peeled(odd: bool, wpq: int) -> bool:
    """Whether an odd count of stages (past one) runs its first stage before the loop
    (`mxfp4.triton.wgmma.peel_first_stage`)."""
    from quantfw.kernels.mxfp4.triton import wgmma

    return odd and wgmma.peel_first_stage(3, wpq)


def stages_compiled(odd: bool, wpq: int = 16) -> int:
    """The kernel's `_stage` bodies: a peeled odd count's first stage, the loop's pair, then an
    odd count's last stage or an even (or peeled) count's last pair."""
    peel = peeled(odd, wpq)
    return int(peel) + 2 + (1 if odd and not peel else 2)


def compile_wgmma(
    decode: str,
    dtype: torch.dtype,
    *,
    bt: int,
    chunk: int,
    stages: int,
    wpq: int = 16,
    odd: bool = False,
    dense: bool = False,
    split: int = 1,
    bias: bool = True,
) -> Any:
    """`mxfp4_wgmma_kernel` compiled for sm_90 with the word decode `decode` (inline PTX),
    activations of `dtype`, ``bt``-token tiles in chunks of ``chunk``, ``stages`` deep, ``wpq``
    words a row and quad; ``odd``: the launch's n_iter is odd (and past one)."""
    from aot import compile_for_sm90
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from quantfw.kernels.mxfp4.triton import wgmma

    def desc_type(t, block, layout):
        d = TensorDescriptor.from_tensor(t, block, layout)
        return native_specialize_impl(BaseBackend, d, False, True, True)[0]

    gdt, name = (gl.float16, "fp16") if dtype == torch.float16 else (gl.bfloat16, "bf16")
    x = torch.zeros(256, 4096, dtype=dtype)
    q = torch.zeros(128, 32 * wpq, dtype=torch.int32)
    mw = wgmma.MAIN_WORDS[wpq]
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    x_layout = gl.NVMMASharedLayout.get_default_for([bt, 64], gdt)
    sig = {"x_desc": desc_type(x, [bt, 64], x_layout), "w_desc": desc_type(q, [128, mw], w_layout),
           "o_desc": desc_type(q, [128, 4], w_layout),
           "s_ptr": "*i32", "bias_ptr": f"*{name}", "out_ptr": f"*{name}", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "block_expert_ptr": "*i32", "block_row_ptr": "*i32",
           "m_indptr_ptr": "*i64", "num_rows": "i32", "N": "i32", "N_PAD": "i32",
           "n_quads": "i32", "n_iter": "i32", "num_experts": "i32", "stride_be": "i32",
           "stride_om": "i32"}  # fmt: skip
    consts = {"BT": bt, "CH": chunk, "S": stages, "ODD": odd, "PEEL": peeled(odd, wpq),
              "HAS_BIAS": bias, "DECODE": decode, "DENSE": dense, "WPQ": wpq,
              "SPLIT": split}  # fmt: skip
    return compile_for_sm90(wgmma.mxfp4_wgmma_kernel, sig, consts, num_warps=8)
