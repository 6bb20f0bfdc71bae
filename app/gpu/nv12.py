"""NV12 (what NVDEC decodes to) → letterboxed model input, in one pass per output pixel.

It does what OpenCV's ``VideoCapture`` (its FFmpeg's swscale YUV → BGR conversion) followed by
the CPU letterbox (``app.imaging.letterbox``) and ``to_input`` do, without the full-size BGR
frame in between: each thread converts the four source pixels its bilinear taps read with
swscale's SIMD arithmetic (``app.imaging.yuv``: the frame's colour matrix and range as six
16-bit constants, chroma shared by each 2×2 block) and blends them with the same fixed-point
weights as ``app.gpu.preprocess.letterbox_kernel``, then writes RGB / 255 into ``[B, 3, S, S]``.
So a frame decoded by NVDEC gives the model the very input OpenCV's decode of it gives.

Frames are read from one flat ``uint8`` staging buffer (a device-to-device copy of each
decoded surface: NVDEC's surfaces are its own and recycled), each at its own offset, with a
row pitch that may exceed the width (NVDEC pads rows) and a UV plane that may start below the
picture's last row (a coded picture is taller than the one shown); the per-frame placement and
colour constants are an int64 row of ``NV12_PARAMS`` columns (``Q_*``), so one launch serves any
mix of stream sizes and colour matrices.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from app.gpu.kernel_cache import configure as configure_kernel_cache
from app.gpu.preprocess import _taps
from app.imaging.letterbox import PAD_VALUE
from app.imaging.yuv import YuvConstants, swscale_constants
from app.types import Letterbox

configure_kernel_cache()  # before the kernels below are defined: they load from it (cache=True)

# Columns of the per-frame params (int64 [B, NV12_PARAMS]): placement, then the colour constants.
Q_Y_OFFSET, Q_UV_OFFSET, Q_PITCH, Q_SRC_H, Q_SRC_W, Q_NEW_H, Q_NEW_W, Q_PAD_TOP, Q_PAD_LEFT = range(9)
Q_Y_COEFF, Q_Y_SUB, Q_V2R, Q_U2B, Q_V2G, Q_U2G = range(9, 15)
NV12_PARAMS = 15
NV12_TPB = 128

_F255 = np.float32(255.0)
_PAD = np.float32(PAD_VALUE) / _F255


@cuda.jit(device=True)
def _sat(v):
    return min(max(v, 0), 255)


@cuda.jit(device=True)
def _rgb(staging, params, b, sy, sx):
    """Source pixel (sy, sx) of frame ``b`` as swscale converts it: ``(r, g, b)`` (the
    module docstring of ``app.imaging.yuv``; ``>> 16`` of a signed product floors, as SIMD's)."""
    pitch = params[b, Q_PITCH]
    luma = (((int(staging[params[b, Q_Y_OFFSET] + sy * pitch + sx]) << 3) - params[b, Q_Y_SUB])
            * params[b, Q_Y_COEFF]) >> 16
    uv = params[b, Q_UV_OFFSET] + (sy >> 1) * pitch + (sx & ~1)
    u = (int(staging[uv]) << 3) - 1024
    v = (int(staging[uv + 1]) << 3) - 1024
    red = _sat(luma + ((v * params[b, Q_V2R]) >> 16))
    green = _sat(luma + ((u * params[b, Q_U2G]) >> 16) + ((v * params[b, Q_V2G]) >> 16))
    blue = _sat(luma + ((u * params[b, Q_U2B]) >> 16))
    return red, green, blue


@cuda.jit(device=True)
def _blend(p00, p01, p10, p11, ax0, ax1, by0, by1):
    """One channel of the four taps, as ``letterbox_kernel`` blends (OpenCV's SIMD resize)."""
    h0 = p00 * ax0 + p01 * ax1
    h1 = p10 * ax0 + p11 * ax1
    v = (((h0 >> 4) * by0) >> 16) + (((h1 >> 4) * by1) >> 16)
    v = min(max((v + 2) >> 2, 0), 255)
    return np.float32(v) / _F255


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
    sy0, sy1, by0, by1 = _taps(y, params[b, Q_SRC_H], new_h, False)
    sx0, sx1, ax0, ax1 = _taps(x, params[b, Q_SRC_W], new_w, True)
    r00, g00, b00 = _rgb(staging, params, b, sy0, sx0)
    r01, g01, b01 = _rgb(staging, params, b, sy0, sx1)
    r10, g10, b10 = _rgb(staging, params, b, sy1, sx0)
    r11, g11, b11 = _rgb(staging, params, b, sy1, sx1)
    out[b, 0, oy, ox] = _blend(r00, r01, r10, r11, ax0, ax1, by0, by1)
    out[b, 1, oy, ox] = _blend(g00, g01, g10, g11, ax0, ax1, by0, by1)
    out[b, 2, oy, ox] = _blend(b00, b01, b10, b11, ax0, ax1, by0, by1)


UNTAGGED = swscale_constants()  # a stream that names no colour matrix: BT.601, limited range (swscale's default)


def fill_nv12_params(row: np.ndarray, lb: Letterbox | None, y_offset: int, pitch: int, luma_rows: int = 0,
                     colour: YuvConstants = UNTAGGED) -> None:
    """One frame's params. The UV plane follows the Y plane's ``luma_rows`` rows of ``pitch``
    bytes (default: the picture's height); a decoder's surface may hold more rows than the
    picture (coded sizes are even, or aligned), and only the top-left ``src_h × src_w`` is read.
    ``colour``: the frame's conversion constants (``app.imaging.yuv.swscale_constants``)."""
    if lb is None:
        row[:] = 0
        return
    row[Q_Y_OFFSET] = y_offset
    row[Q_UV_OFFSET] = y_offset + max(luma_rows, lb.src_h) * pitch
    row[Q_PITCH] = pitch
    row[Q_SRC_H], row[Q_SRC_W] = lb.src_h, lb.src_w
    row[Q_NEW_H], row[Q_NEW_W] = lb.new_h, lb.new_w
    row[Q_PAD_TOP], row[Q_PAD_LEFT] = lb.pad_top, lb.pad_left
    row[Q_Y_COEFF], row[Q_Y_SUB], row[Q_V2R], row[Q_U2B], row[Q_V2G], row[Q_U2G] = colour


def launch_nv12_letterbox(staging, params, out, batch: int, stream=0) -> None:
    """Launch :func:`nv12_letterbox_kernel` for the first ``batch`` frames of ``out``."""
    size = out.shape[2]
    grid = ((size * size + NV12_TPB - 1) // NV12_TPB, batch)
    nv12_letterbox_kernel[grid, NV12_TPB, stream](staging, params, out)
