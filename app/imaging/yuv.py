"""YUV 4:2:0 → BGR exactly as OpenCV's ``VideoCapture`` converts decoded video frames.

OpenCV's FFmpeg backend hands each decoded ``yuv420p`` picture to swscale (``BGR24``, same
size). An unscaled 4:2:0 → 24-bit RGB conversion takes swscale's special converter, and on an
x86 CPU with SSSE3 that is its SIMD one (libswscale ``yuv2rgb``, ``yuv_420_bgr24``): 16-bit
fixed point with truncating multiplies, one chroma sample per 2×2 block:

    Y' = mulhi(8·y − y_offset, y_coeff)        mulhi(a, b) = floor(a·b / 65536)
    U' = 8·u − 1024,  V' = 8·v − 1024
    B = sat(Y' + mulhi(U', u2b)),  R = sat(Y' + mulhi(V', v2r)),
    G = sat(Y' + mulhi(U', u2g) + mulhi(V', v2g))                 sat: clamp to [0, 255]

The six constants follow from the stream's colour matrix and range (``swscale_constants``,
derived as swscale's ``ff_yuv2rgb_c_init_tables`` does for its SIMD tables). The opencv-python
5.0 wheel (its bundled FFmpeg 8.1) takes the matrix and range from the decoded frame: a BT.709
stream converts with BT.709's, an untagged one with BT.601's (swscale's default), a full-range
one (``yuvj420p``) without the 16-235 expansion. bench/results/README.md names the run that
found every pixel of the shared clips equal this way.

``yuv420_to_bgr`` is the host reference the GPU's NV12 kernel (``app.gpu.nv12``) is held to.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

# FFmpeg's AVColorSpace codes (what a decoder reports for the matrix_coefficients of the stream).
COLORSPACE_BT709 = 1
COLORSPACE_UNSPECIFIED = 2
COLORSPACE_BT601 = 6  # SMPTE 170M; 5 (BT.470BG) has the same coefficients

# swscale's YCbCr → RGB table {crv, cbu, cgu, cgv} per AVColorSpace code (0-10); codes it does
# not list (8: YCgCo, 11 and over) take its default, BT.601's.
_BT601 = (104597, 132201, 25675, 53279)
_TABLES = {
    1: (117489, 138438, 13975, 34925),  # BT.709
    4: (104448, 132798, 24759, 53109),  # FCC
    7: (117579, 136230, 16907, 35559),  # SMPTE 240M
    9: (110013, 140363, 12277, 42626),  # BT.2020 non-constant luminance
    10: (110013, 140363, 12277, 42626),  # BT.2020 constant luminance
}


class YuvConstants(NamedTuple):
    """The SIMD converter's six 16-bit constants (see the module docstring)."""

    y_coeff: int
    y_offset: int
    v2r: int
    u2b: int
    v2g: int
    u2g: int


def _round16(value: int) -> int:
    """swscale's ``roundToInt16``: a 16.16 fixed-point value to the nearest int16 (saturated)."""
    r = (value + (1 << 15)) >> 16
    return max(-0x7FFF, min(0x7FFF, r))


def _trunc_div(a: int, b: int) -> int:
    """C's integer division (toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


@lru_cache(maxsize=64)
def swscale_constants(colorspace: int = COLORSPACE_UNSPECIFIED, full_range: bool = False) -> YuvConstants:
    """The constants swscale converts a frame of this AVColorSpace code and range with."""
    crv, cbu, cgu, cgv = _TABLES.get(int(colorspace), _BT601)
    cgu, cgv = -cgu, -cgv
    if full_range:
        cy, oy = 1 << 16, 0
        crv, cbu, cgu, cgv = (_trunc_div(c * 224, 255) for c in (crv, cbu, cgu, cgv))
    else:
        cy, oy = (1 << 16) * 255 // 219, 16 << 16
    # contrast and saturation are 1.0 (1 << 16) and brightness 0: the products leave them as they are.
    return YuvConstants(_round16(cy << 13), _round16(oy << 3), _round16(crv << 13), _round16(cbu << 13),
                        _round16(cgv << 13), _round16(cgu << 13))


def _mulhi(a: np.ndarray, b: int) -> np.ndarray:
    return (a * np.int32(b)) >> 16  # arithmetic shift: floor, as the SIMD multiply-high


def yuv420_to_bgr(y: np.ndarray, u: np.ndarray, v: np.ndarray, k: YuvConstants) -> np.ndarray:
    """BGR uint8 ``[H, W, 3]`` of the planes ``y`` ``[H, W]``, ``u`` and ``v`` ``[ceil(H/2), ceil(W/2)]``."""
    h, w = y.shape
    yy = _mulhi((y.astype(np.int32) << 3) - k.y_offset, k.y_coeff)
    uu = (u.astype(np.int32) << 3) - 1024
    vv = (v.astype(np.int32) << 3) - 1024

    def full(chroma: np.ndarray) -> np.ndarray:  # one sample per 2x2 block
        return np.repeat(np.repeat(chroma, 2, axis=0), 2, axis=1)[:h, :w]

    b = yy + full(_mulhi(uu, k.u2b))
    g = yy + full(_mulhi(uu, k.u2g) + _mulhi(vv, k.v2g))
    r = yy + full(_mulhi(vv, k.v2r))
    return np.clip(np.stack([b, g, r], axis=-1), 0, 255).astype(np.uint8)


def nv12_to_bgr(nv12: np.ndarray, height: int, width: int, k: YuvConstants) -> np.ndarray:
    """The same for an NV12 ``[rows, pitch]`` array (a decoder's surface: the Y plane's
    ``rows * 2 / 3`` rows, then interleaved UV), whose top-left ``height × width`` is shown."""
    luma_rows = nv12.shape[0] * 2 // 3
    uv = nv12[luma_rows : luma_rows + (height + 1) // 2, : 2 * ((width + 1) // 2)]
    return yuv420_to_bgr(nv12[:height, :width], uv[:, 0::2], uv[:, 1::2], k)
