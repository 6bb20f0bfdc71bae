"""GPU preprocessing: batched nvJPEG decode, then one fused letterbox kernel per batch.

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
import re
import warnings
from collections.abc import Sequence

import numpy as np
from numba import cuda

from app.errors import InvalidImage, YolopipeError
from app.gpu.rounding import dmul, dsub
from app.imaging.letterbox import PAD_VALUE, letterbox_params
from app.imaging.decode import decode_image
from app.imaging.headers import sniff_format
from app.types import Letterbox

# Columns of the per-image params array (int64 [B, PARAMS_PER_IMAGE]).
P_OFFSET, P_SRC_H, P_SRC_W, P_NEW_H, P_NEW_W, P_PAD_TOP, P_PAD_LEFT, P_LAYOUT = range(8)
PARAMS_PER_IMAGE = 8
LAYOUT_HWC_BGR = 0  # OpenCV frames: [H, W, 3] BGR
LAYOUT_CHW_RGB = 1  # nvJPEG output: [3, H, W] RGB

LETTERBOX_TPB = 128  # threads per block; one thread per output pixel (all 3 channels)

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


@cuda.jit
def letterbox_kernel(staging, params, out):
    """Grid ``(ceil(S*S / TPB), B)``: one thread per output pixel of image ``blockIdx.y``.

    ``staging``: uint8 [N]; ``params``: int64 [>= B, PARAMS_PER_IMAGE];
    ``out``: float32 or float16 [B, 3, S, S]. An image with ``new_h == 0`` (a padding slot of
    a bucket) comes out as pure padding.
    """
    b = cuda.blockIdx.y
    size = out.shape[2]
    pix = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if pix >= size * size:
        return
    oy = pix // size
    ox = pix - oy * size
    new_h = params[b, P_NEW_H]
    new_w = params[b, P_NEW_W]
    y = oy - params[b, P_PAD_TOP]
    x = ox - params[b, P_PAD_LEFT]
    if y < 0 or y >= new_h or x < 0 or x >= new_w:
        out[b, 0, oy, ox] = _PAD
        out[b, 1, oy, ox] = _PAD
        out[b, 2, oy, ox] = _PAD
        return
    src_h = params[b, P_SRC_H]
    src_w = params[b, P_SRC_W]
    base = params[b, P_OFFSET]
    sy0, sy1, by0, by1 = _taps(y, src_h, new_h, False)
    sx0, sx1, ax0, ax1 = _taps(x, src_w, new_w, True)
    chw = params[b, P_LAYOUT] == LAYOUT_CHW_RGB
    for c in range(3):  # c: output channel, RGB order
        if chw:  # [3, H, W] RGB
            plane = base + c * src_h * src_w
            p00 = plane + sy0 * src_w + sx0
            p01 = plane + sy0 * src_w + sx1
            p10 = plane + sy1 * src_w + sx0
            p11 = plane + sy1 * src_w + sx1
        else:  # [H, W, 3] BGR: channel 2 - c
            ch = 2 - c
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
    grid = ((size * size + LETTERBOX_TPB - 1) // LETTERBOX_TPB, batch)
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


# ------------------------------------------------------------------------------ JPEG decode
_EXIF_ORIENTATION_TAG = 0x0112


def exif_orientation(data: bytes) -> int:
    """The EXIF orientation (1..8) of a JPEG, 1 when absent or unreadable.

    nvJPEG ignores EXIF, while ``cv2.imdecode`` (the CPU path, Ultralytics' reader) applies it,
    so the GPU path reads the tag itself and turns the decoded image the same way.
    """
    i = 2
    n = len(data)
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker in (0xD9, 0xDA):  # end of image / start of scan: no more headers
            break
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xE1 and data[i + 4 : i + 10] == b"Exif\x00\x00":
            return _tiff_orientation(data[i + 10 : i + 2 + length])
        i += 2 + length
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for k in range(count):
        entry = ifd + 2 + 12 * k
        if entry + 12 > len(tiff):
            break
        if int.from_bytes(tiff[entry : entry + 2], order) == _EXIF_ORIENTATION_TAG:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)  # SHORT, left-justified
            return value if 1 <= value <= 8 else 1
    return 1


def apply_orientation(chw, orientation: int):
    """Turn a ``[C, H, W]`` tensor as EXIF ``orientation`` says (PIL's ``exif_transpose``)."""
    if orientation == 2:
        return chw.flip(2)
    if orientation == 3:
        return chw.flip(1).flip(2)
    if orientation == 4:
        return chw.flip(1)
    if orientation == 5:
        return chw.transpose(1, 2)
    if orientation == 6:  # rotate 90° clockwise
        return chw.transpose(1, 2).flip(2)
    if orientation == 7:
        return chw.transpose(1, 2).flip(1).flip(2)
    if orientation == 8:  # rotate 90° counter-clockwise
        return chw.transpose(1, 2).flip(1)
    return chw


def decode_jpegs(datas: Sequence[bytes], device: int = 0) -> list:
    """JPEG bytes → ``[3, H, W]`` RGB uint8 CUDA tensors, or the error of each bad one.

    One batched nvJPEG call (``torchvision.io.decode_jpeg``) on torch's current stream; when
    the batch fails, each image is retried alone so one corrupt file fails only its own slot.
    An image nvJPEG cannot decode falls back to the CPU decoder (which also reports corrupt
    data as ``InvalidImage``) and comes back as a ``[H, W, 3]`` BGR ``np.ndarray``.
    """
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) if d else None for d in datas]
    out: list = [None] * len(datas)
    todo = [i for i, e in enumerate(encoded) if e is not None and sniff_format(datas[i]) == "jpeg"]
    todo_set = set(todo)
    for i in range(len(datas)):
        if i not in todo_set:
            out[i] = _cpu_decode(datas[i])
    if not todo:
        return out
    target = torch.device("cuda", device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision's deprecation notice about decode_jpeg
        try:
            decoded = decode_jpeg([encoded[i] for i in todo], mode=ImageReadMode.RGB, device=target)
        except RuntimeError:
            decoded = []
            for i in todo:
                try:
                    decoded.append(decode_jpeg(encoded[i], mode=ImageReadMode.RGB, device=target))
                except RuntimeError:
                    decoded.append(None)
    for i, img in zip(todo, decoded):
        if img is None or img.ndim != 3 or img.shape[0] != 3:
            out[i] = _cpu_decode(datas[i])
            continue
        orientation = exif_orientation(datas[i])
        out[i] = apply_orientation(img, orientation) if orientation != 1 else img
    return out


def _cpu_decode(data: bytes) -> np.ndarray | YolopipeError:
    try:
        return decode_image(data)
    except YolopipeError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - any decoder failure is this image's fault
        detail = re.sub(r"\s+", " ", str(exc))[:200]
        return InvalidImage(f"cannot decode image: {detail}")
