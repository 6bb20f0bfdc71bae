"""CPU decode and letterbox, equal to what Ultralytics does before its model.

These functions are also the reference that the GPU preprocessing is tested against.
"""

from __future__ import annotations

import cv2
import numpy as np

from app.errors import ImageTooLarge, InvalidImage, UnsupportedMediaType
from app.types import Letterbox

PAD_VALUE = 114
DEFAULT_MAX_PIXELS = 50_000_000

# Magic numbers of the formats OpenCV decodes for us; anything else is not an image we take.
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"RIFF", "webp"),
)


def sniff_format(data: bytes) -> str | None:
    """The image format named by the first bytes, or None when it is not one we decode."""
    for magic, name in _SIGNATURES:
        if data.startswith(magic):
            if name == "webp" and data[8:12] != b"WEBP":
                return None
            return name
    return None


def image_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) read from the header alone, before any pixel is decoded; None if unknown."""
    fmt = sniff_format(data)
    if fmt == "png" and len(data) >= 24:
        return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")
    if fmt == "jpeg":
        i = 2
        while i + 9 < len(data):
            if data[i] != 0xFF:
                return None
            marker = data[i + 1]
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                i += 2
                continue
            length = int.from_bytes(data[i + 2 : i + 4], "big")
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                return int.from_bytes(data[i + 5 : i + 7], "big"), int.from_bytes(data[i + 7 : i + 9], "big")
            i += 2 + length
    return None


def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Bytes → BGR uint8 ``[H, W, 3]``, as Ultralytics' ``imread`` reads a file.

    OpenCV's ``IMREAD_COLOR`` applies the EXIF orientation, expands grayscale to three channels
    and drops alpha; 16-bit images keep their high byte. The pixel limit is checked on the
    header first, so a decompression bomb is refused before it is decoded.
    """
    if not data:
        raise InvalidImage("empty image")
    fmt = sniff_format(data)
    if fmt is None:
        raise UnsupportedMediaType("not an image in a supported format (JPEG, PNG, BMP, TIFF, WebP)")
    size = image_size(data)
    if size is not None and size[0] * size[1] > max_pixels:
        raise ImageTooLarge(f"image has {size[0] * size[1]:,} pixels, the limit is {max_pixels:,}")
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if img is None or img.size == 0:
        raise InvalidImage(f"cannot decode this {fmt.upper()} image (truncated or corrupt)")
    if img.shape[0] * img.shape[1] > max_pixels:
        raise ImageTooLarge(f"image has {img.shape[0] * img.shape[1]:,} pixels, the limit is {max_pixels:,}")
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)
    return img


def letterbox_params(src_h: int, src_w: int, size: int) -> Letterbox:
    """Placement of a ``src_h × src_w`` image in a ``size × size`` square, as Ultralytics' ``LetterBox``."""
    r = min(size / src_h, size / src_w)
    new_w, new_h = max(round(src_w * r), 1), max(round(src_h * r), 1)
    dw, dh = (size - new_w) / 2, (size - new_h) / 2
    # Ultralytics rounds (pad - 0.1) on the top/left side; the rest goes to bottom/right.
    return Letterbox(src_h, src_w, new_h, new_w, pad_top=round(dh - 0.1), pad_left=round(dw - 0.1), size=size)


def letterbox(img: np.ndarray, size: int) -> tuple[np.ndarray, Letterbox]:
    """Resize (bilinear, OpenCV) and pad with 114 into a ``size × size`` BGR uint8 image."""
    lb = letterbox_params(img.shape[0], img.shape[1], size)
    if (img.shape[1], img.shape[0]) != (lb.new_w, lb.new_h):
        img = cv2.resize(img, (lb.new_w, lb.new_h), interpolation=cv2.INTER_LINEAR)
    bottom = size - lb.new_h - lb.pad_top
    right = size - lb.new_w - lb.pad_left
    out = cv2.copyMakeBorder(
        img, lb.pad_top, bottom, lb.pad_left, right, cv2.BORDER_CONSTANT, value=(PAD_VALUE,) * 3
    )
    return out, lb


def to_input(letterboxed: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """BGR uint8 HWC images → RGB float32 NCHW in [0, 1] (the ONNX model's input)."""
    batch = np.stack(letterboxed)[..., ::-1].transpose(0, 3, 1, 2)
    if out is None:
        out = np.empty(batch.shape, np.float32)
    # Divide (not multiply by 1/255): bit-equal to Ultralytics' ``im /= 255`` in float32.
    np.divide(batch, np.float32(255), out=out, casting="unsafe")
    return out
