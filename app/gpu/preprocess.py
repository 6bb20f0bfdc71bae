"""GPU preprocessing: one fused letterbox kernel per batch (decoding lives in ``app.gpu.decode``).

The letterbox kernel does what ``app.imaging.letterbox.letterbox`` + ``to_input`` do on the
CPU, in one pass and straight into the engine's input buffer ``[B, 3, S, S]``:

    bilinear resize (OpenCV ``INTER_LINEAR``) → pad 114 → BGR→RGB → /255 → HWC→CHW

It reads every image from one flat ``uint8`` staging buffer at a per-image byte offset, with
the per-image placement in a small *device* array of int64 (``PARAMS_PER_IMAGE`` columns, see
the ``P_*`` indices). Nothing about the images is baked into the launch, so one launch captured
in a CUDA graph serves any mix of image sizes; only the staging buffer and the params change.

Resize arithmetic: OpenCV resizes 8-bit images with 11-bit fixed-point weights, not floats.
The kernel reproduces that arithmetic (coordinate mapping in float64/float32 as OpenCV does,
weights rounded to 1/2048, OpenCV's SIMD vertical pass ``((h0>>4)*b0>>16) + ((h1>>4)*b1>>16)``
with a rounding shift), so nearly every pixel equals the CPU reference bit for bit; OpenCV's
scalar tail of a row rounds in one step and can differ by one level (1/255), the bound the
tests check.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, int32

from app.gpu.kernel_cache import configure as configure_kernel_cache
from app.gpu.rounding import dmul, dsub, quiet_low_occupancy_warnings
from app.imaging.letterbox import PAD_VALUE, letterbox_params
from app.types import Letterbox

configure_kernel_cache()  # before the kernels below are defined: they load from it (cache=True)

quiet_low_occupancy_warnings()

# Columns of the per-image params array (int64 [B, PARAMS_PER_IMAGE]).
P_OFFSET, P_SRC_H, P_SRC_W, P_NEW_H, P_NEW_W, P_PAD_TOP, P_PAD_LEFT, P_LAYOUT = range(8)
PARAMS_PER_IMAGE = 8
LAYOUT_HWC_BGR = 0  # OpenCV frames: [H, W, 3] BGR
LAYOUT_CHW_RGB = 1  # torchvision nvJPEG output: [3, H, W] RGB
LAYOUT_HWC_RGB = 2  # nvImageCodec output: [H, W, 3] RGB

# A block writes LETTERBOX_TPB output columns of LETTERBOX_ROWS rows of one image: each thread's
# horizontal taps serve its column's 8 pixels, and each row's vertical taps, worked out once by one
# thread into shared memory, the block's 128. (One thread per pixel, each working out both, took
# 0.53 ms per batch of 64 at 640 on an H100, 5.6 % of the engine's time beside it.)
LETTERBOX_TPB = 128
LETTERBOX_ROWS = 8

_F255 = np.float32(255.0)
_PAD = np.float32(PAD_VALUE) / _F255  # exactly what to_input computes for a padded pixel
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_COEF_SCALE = np.float32(2048.0)  # OpenCV's INTER_RESIZE_COEF_SCALE (11 bits)


# OpenCV computes ``(dx + 0.5) * scale - 0.5`` in double with one rounding per operation;
# ``dmul``/``dsub`` keep NVVM from contracting it into an FMA (app/gpu/rounding.py).


@cuda.jit(device=True)
def _round_half_even(v):
    """``cvRound`` of a float (``lrintf``: ties to even), as an int."""
    f = math.floor(v)
    d = v - f
    r = int(f)
    if d > 0.5 or (d == 0.5 and (r & 1) == 1):
        r += 1
    return r


@cuda.jit(device=True)
def _taps(d, src_len, dst_len, reset_at_borders):
    """Source index and fixed-point weights of output coordinate ``d`` (OpenCV's ``resize``).

    ``fx = (float)((d + 0.5) * scale - 0.5)`` with ``scale = 1 / (dst / src)`` in double;
    ``s = floor(fx)``; in x the border taps are reset to weight (1, 0) (``reset_at_borders``),
    in y OpenCV keeps the weights and clamps the two row indices instead.
    Returns ``(s0, s1, w0, w1)``: clamped source indices and weights summing to about 2048.
    """
    scale = 1.0 / (np.float64(dst_len) / np.float64(src_len))
    f = np.float32(dsub(dmul(np.float64(d) + 0.5, scale), 0.5))
    s = int(math.floor(f))  # noqa: RUF046 - Numba types math.floor(float32) as a float
    f = np.float32(f - np.float32(s))
    if reset_at_borders:
        if s < 0:
            f = _F0
            s = 0
        if s >= src_len - 1:
            f = _F0
            s = src_len - 1
    w0 = _round_half_even(np.float32(_F1 - f) * _COEF_SCALE)
    w1 = _round_half_even(f * _COEF_SCALE)
    s0 = min(max(s, 0), src_len - 1)
    s1 = min(max(s + 1, 0), src_len - 1)
    return s0, s1, w0, w1


@cuda.jit(cache=True)
def letterbox_kernel(staging, params, out):
    """Grid ``(ceil(S / LETTERBOX_TPB), ceil(S / LETTERBOX_ROWS), B)``, ``LETTERBOX_TPB`` threads a
    block: block ``(i, j, b)`` writes columns ``i * TPB ...`` of rows ``j * ROWS ...`` of image
    ``b``, a thread a column.

    ``staging``: uint8 [N]; ``params``: int64 [>= B, PARAMS_PER_IMAGE];
    ``out``: float32 or float16 [B, 3, S, S]. An image with ``new_h == 0`` (a padding slot of
    a bucket) comes out as pure padding.
    """
    b = cuda.blockIdx.z
    size = out.shape[2]
    tx = cuda.threadIdx.x
    ox = cuda.blockIdx.x * cuda.blockDim.x + tx
    row0 = cuda.blockIdx.y * LETTERBOX_ROWS
    new_h = params[b, P_NEW_H]
    new_w = params[b, P_NEW_W]
    pad_top = params[b, P_PAD_TOP]
    src_h = params[b, P_SRC_H]
    src_w = params[b, P_SRC_W]
    # The rows' vertical taps (source rows, weights), one thread a row.
    row_taps = cuda.shared.array((LETTERBOX_ROWS, 4), int32)
    if tx < LETTERBOX_ROWS:
        y = row0 + tx - pad_top
        if row0 + tx < size and 0 <= y < new_h:
            sy0, sy1, by0, by1 = _taps(y, src_h, new_h, False)
            row_taps[tx, 0] = sy0
            row_taps[tx, 1] = sy1
            row_taps[tx, 2] = by0
            row_taps[tx, 3] = by1
    cuda.syncthreads()
    if ox >= size:
        return
    x = ox - params[b, P_PAD_LEFT]
    inside = 0 <= x < new_w
    sx0, sx1, ax0, ax1 = 0, 0, 0, 0
    if inside:
        sx0, sx1, ax0, ax1 = _taps(x, src_w, new_w, True)
    base = params[b, P_OFFSET]
    layout = params[b, P_LAYOUT]
    for r in range(LETTERBOX_ROWS):
        oy = row0 + r
        if oy >= size:
            return
        y = oy - pad_top
        if not inside or y < 0 or y >= new_h:
            out[b, 0, oy, ox] = _PAD
            out[b, 1, oy, ox] = _PAD
            out[b, 2, oy, ox] = _PAD
            continue
        sy0 = row_taps[r, 0]
        sy1 = row_taps[r, 1]
        by0 = row_taps[r, 2]
        by1 = row_taps[r, 3]
        for c in range(3):  # c: output channel, RGB order
            if layout == LAYOUT_CHW_RGB:  # [3, H, W] RGB
                plane = base + c * src_h * src_w
                p00 = plane + sy0 * src_w + sx0
                p01 = plane + sy0 * src_w + sx1
                p10 = plane + sy1 * src_w + sx0
                p11 = plane + sy1 * src_w + sx1
            else:  # [H, W, 3]: BGR reads channel 2 - c, RGB channel c
                ch = 2 - c if layout == LAYOUT_HWC_BGR else c
                p00 = base + (sy0 * src_w + sx0) * 3 + ch
                p01 = base + (sy0 * src_w + sx1) * 3 + ch
                p10 = base + (sy1 * src_w + sx0) * 3 + ch
                p11 = base + (sy1 * src_w + sx1) * 3 + ch
            # Horizontal pass: ints scaled by 2048 (OpenCV's HResizeLinear).
            h0 = int(staging[p00]) * ax0 + int(staging[p01]) * ax1
            h1 = int(staging[p10]) * ax0 + int(staging[p11]) * ax1
            # Vertical pass as OpenCV's SIMD VResizeLinearVec_32s8u: mul_hi of (h >> 4) by the
            # 16-bit weight, then a rounding shift by 2, saturated to [0, 255].
            v = (((h0 >> 4) * by0) >> 16) + (((h1 >> 4) * by1) >> 16)
            v = (v + 2) >> 2
            v = min(max(v, 0), 255)
            out[b, c, oy, ox] = np.float32(v) / _F255


def launch_letterbox(staging, params, out, batch: int, stream=0) -> None:
    """Launch :func:`letterbox_kernel` for the first ``batch`` images of ``out`` (Numba arrays)."""
    size = out.shape[2]
    grid = ((size + LETTERBOX_TPB - 1) // LETTERBOX_TPB, (size + LETTERBOX_ROWS - 1) // LETTERBOX_ROWS, batch)
    letterbox_kernel[grid, LETTERBOX_TPB, stream](staging, params, out)


def fill_params(row: np.ndarray, lb: Letterbox | None, offset: int, layout: int) -> None:
    """Write one image's params into ``row`` (int64 [PARAMS_PER_IMAGE]); ``lb=None``: an empty slot."""
    if lb is None:
        row[:] = 0  # new_h = new_w = 0: the whole image is padding
        return
    row[P_OFFSET] = offset
    row[P_SRC_H] = lb.src_h
    row[P_SRC_W] = lb.src_w
    row[P_NEW_H] = lb.new_h
    row[P_NEW_W] = lb.new_w
    row[P_PAD_TOP] = lb.pad_top
    row[P_PAD_LEFT] = lb.pad_left
    row[P_LAYOUT] = layout


def letterbox_placement(src_h: int, src_w: int, size: int) -> Letterbox:
    """The placement the kernel uses: Ultralytics' rounding, from the CPU module."""
    return letterbox_params(src_h, src_w, size)
