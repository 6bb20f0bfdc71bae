"""Bytes → BGR pixels on the CPU, exactly as Ultralytics reads a file (OpenCV)."""

from __future__ import annotations

import cv2
import numpy as np

from app.config import MAX_PIXELS
from app.errors import ImageTooLarge, InvalidImage, UnsupportedMediaType
from app.imaging.headers import image_size, sniff_format



def decode_image(data: bytes, *, max_pixels: int = MAX_PIXELS) -> np.ndarray:
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
