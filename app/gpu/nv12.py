"""NV12 (what NVDEC decodes to) → letterboxed model input, in one pass per output pixel.

It does what ``cv2.cvtColor(nv12, COLOR_YUV2BGR_NV12)`` followed by the CPU letterbox
(``app.imaging.letterbox``) and ``to_input`` do, without the full-size BGR frame in between:
each thread converts the four source pixels its bilinear taps read (OpenCV's BT.601
limited-range integer arithmetic, chroma shared by each 2×2 block) and blends them with the
same fixed-point weights as ``app.gpu.preprocess.letterbox_kernel``, then writes RGB / 255
into ``[B, 3, S, S]``.

Frames are read from one flat ``uint8`` staging buffer (a device-to-device copy of each
decoded surface: NVDEC's surfaces are its own and recycled), each at its own offset, with a
row pitch that may exceed the width (NVDEC pads rows) and a UV plane that may start below the
picture's last row (a coded picture is taller than the one shown); the per-frame placement is
an int64 row of ``NV12_PARAMS`` columns (``Q_*``), so one launch serves any mix of stream sizes.
On the frames tests/kernels/test_nv12_kernel.py uses, the output is bit-equal to OpenCV's.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from app.gpu.kernel_cache import configure as configure_kernel_cache
from app.gpu.preprocess import _taps
from app.imaging.letterbox import PAD_VALUE
from app.types import Letterbox

configure_kernel_cache()  # before the kernels below are defined: they load from it (cache=True)

# Columns of the per-frame params (int64 [B, NV12_PARAMS]).
Q_Y_OFFSET, Q_UV_OFFSET, Q_PITCH, Q_SRC_H, Q_SRC_W, Q_NEW_H, Q_NEW_W, Q_PAD_TOP, Q_PAD_LEFT = range(9)
NV12_PARAMS = 9
NV12_TPB = 128

_F255 = np.float32(255.0)
_PAD = np.float32(PAD_VALUE) / _F255
# OpenCV's YUV420 → RGB constants (color_yuv.simd.hpp): BT.601 limited range, 20-bit fixed point.
_SHIFT = 20
_HALF = 1 << (_SHIFT - 1)
_CY, _CUB, _CUG, _CVG, _CVR = 1220542, 2116026, -409993, -852492, 1673527


@cuda.jit(device=True)
def _sat(v):
    return min(max(v, 0), 255)


@cuda.jit(device=True)
def _channel(staging, y_off, uv_off, pitch, sy, sx, c):
    """Channel ``c`` (0 R, 1 G, 2 B) of source pixel (sy, sx), as OpenCV converts it."""
    luma = max(int(staging[y_off + sy * pitch + sx]) - 16, 0) * _CY
    uv = uv_off + (sy >> 1) * pitch + (sx & ~1)
    u = int(staging[uv]) - 128
    v = int(staging[uv + 1]) - 128
    if c == 0:
        return _sat((luma + _HALF + _CVR * v) >> _SHIFT)
    if c == 1:
        return _sat((luma + _HALF + _CVG * v + _CUG * u) >> _SHIFT)
    return _sat((luma + _HALF + _CUB * u) >> _SHIFT)


@cuda.jit(cache=True)
def nv12_letterbox_kernel(staging, params, out):
    """Grid ``(ceil(S*S / TPB), B)``: one thread per output pixel of frame ``blockIdx.y``; a frame
    with ``new_h == 0`` (an empty slot) comes out as pure padding."""
    b = cuda.blockIdx.y
    size = out.shape[2]
    pix = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if pix >= size * size:
        return
    oy = pix // size
    ox = pix - oy * size
    new_h = params[b, Q_NEW_H]
    new_w = params[b, Q_NEW_W]
    y = oy - params[b, Q_PAD_TOP]
    x = ox - params[b, Q_PAD_LEFT]
    if y < 0 or y >= new_h or x < 0 or x >= new_w:
        out[b, 0, oy, ox] = _PAD
        out[b, 1, oy, ox] = _PAD
        out[b, 2, oy, ox] = _PAD
        return
    src_h = params[b, Q_SRC_H]
    src_w = params[b, Q_SRC_W]
    y_off = params[b, Q_Y_OFFSET]
    uv_off = params[b, Q_UV_OFFSET]
    pitch = params[b, Q_PITCH]
    sy0, sy1, by0, by1 = _taps(y, src_h, new_h, False)
    sx0, sx1, ax0, ax1 = _taps(x, src_w, new_w, True)
    for c in range(3):
        h0 = _channel(staging, y_off, uv_off, pitch, sy0, sx0, c) * ax0 + \
            _channel(staging, y_off, uv_off, pitch, sy0, sx1, c) * ax1
        h1 = _channel(staging, y_off, uv_off, pitch, sy1, sx0, c) * ax0 + \
            _channel(staging, y_off, uv_off, pitch, sy1, sx1, c) * ax1
        v = (((h0 >> 4) * by0) >> 16) + (((h1 >> 4) * by1) >> 16)  # as letterbox_kernel (OpenCV SIMD)
        v = min(max((v + 2) >> 2, 0), 255)
        out[b, c, oy, ox] = np.float32(v) / _F255


def fill_nv12_params(row: np.ndarray, lb: Letterbox | None, y_offset: int, pitch: int, luma_rows: int = 0) -> None:
    """One frame's params. The UV plane follows the Y plane's ``luma_rows`` rows of ``pitch``
    bytes (default: the picture's height); a decoder's surface may hold more rows than the
    picture (coded sizes are even, or aligned), and only the top-left ``src_h × src_w`` is read."""
    if lb is None:
        row[:] = 0
        return
    row[Q_Y_OFFSET] = y_offset
    row[Q_UV_OFFSET] = y_offset + max(luma_rows, lb.src_h) * pitch
    row[Q_PITCH] = pitch
    row[Q_SRC_H], row[Q_SRC_W] = lb.src_h, lb.src_w
    row[Q_NEW_H], row[Q_NEW_W] = lb.new_h, lb.new_w
    row[Q_PAD_TOP], row[Q_PAD_LEFT] = lb.pad_top, lb.pad_left


def launch_nv12_letterbox(staging, params, out, batch: int, stream=0) -> None:
    """Launch :func:`nv12_letterbox_kernel` for the first ``batch`` frames of ``out``."""
    size = out.shape[2]
    grid = ((size * size + NV12_TPB - 1) // NV12_TPB, batch)
    nv12_letterbox_kernel[grid, NV12_TPB, stream](staging, params, out)
