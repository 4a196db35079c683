"""Lane indices of Gluon layouts that several kernels share."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def lane_in_quad(L: gl.constexpr):
    """Lane ``c = 2 j + h`` of a quad of lanes laid along dims 3 (j) and 4 (h) of the 6-D
    layout `L`, as an int32 ``[1, 1, 1, 2, 2, 1]`` tensor of `L` (it broadcasts over tensors
    of that layout): the packed-weight kernels read one word into two or four such lanes and
    shift it by the lane (`mxfp4.triton.wgmma`, `kbit.triton.mma`)."""
    j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(
        2, gl.SliceLayout(4, gl.SliceLayout(5, L))))))  # fmt: skip
    j = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.expand_dims(j, 0), 1), 2), 4), 5)  # fmt: skip
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(
        2, gl.SliceLayout(3, gl.SliceLayout(5, L))))))  # fmt: skip
    h = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.expand_dims(h, 0), 1), 2), 3), 5)  # fmt: skip
    return 2 * j + h
