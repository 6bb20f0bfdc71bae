"""Bytes → BGR pixels on the CPU, exactly as Ultralytics reads a file (OpenCV), under a pixel
and a memory budget checked on the header before anything is decoded (``app.imaging.check``)."""

from __future__ import annotations

import re

import cv2
import numpy as np

from app.config import MAX_DECODE_BYTES, MAX_PIXELS
from app.errors import ImageTooLarge, InvalidImage
from app.imaging.check import check_image, check_whole, decode_bytes, undecodable  # noqa: F401 (decode_bytes: read with the decode)
from app.imaging.headers import ImageHeader


def decode_image(
    data: bytes | np.ndarray, *, max_pixels: int = MAX_PIXELS, max_decode_bytes: int = MAX_DECODE_BYTES,
    header: ImageHeader | None = None,
) -> np.ndarray:
    """Bytes → BGR uint8 ``[H, W, 3]``, as Ultralytics' ``imread`` reads a file.

    OpenCV's ``IMREAD_COLOR`` applies the EXIF orientation, expands grayscale and palettes to
    three channels and drops alpha; 16-bit images keep their high byte. A colour TIFF is read
    as Ultralytics reads ``.tif`` files (its own depth, then the high byte), so a 16-bit one
    truncates rather than rounds. OpenCV's own errors (its pixel cap, a corrupt stream) become
    ``ImageTooLarge`` or ``InvalidImage``, never an unexpected exception. ``data``: the bytes, or
    a uint8 array viewing them (``app.contracts.EncodedImage``'s), decoded where they lie.
    """
    if header is None:  # else checked already (by whoever read it: an HTTP worker); the header reader reads bytes
        header = check_image(data if isinstance(data, bytes) else bytes(data), max_pixels=max_pixels,
                             max_decode_bytes=max_decode_bytes)
    else:
        check_whole(header)  # whoever read it may have read it only
    flags = cv2.IMREAD_COLOR
    if header.format == "tiff" and header.bits > 8 and header.channels >= 3:
        flags |= cv2.IMREAD_ANYDEPTH
    try:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    except cv2.error as exc:
        raise _decode_error(exc, header) from None
    if img is None or img.size == 0:
        raise undecodable(header.format)
    if img.shape[0] * img.shape[1] > max_pixels:  # the header lied in a way its parser did not catch
        raise ImageTooLarge(f"image has {img.shape[0] * img.shape[1]:,} pixels, the limit is {max_pixels:,}")
    if img.dtype == np.uint16:  # the high byte, shifted in place: a 50 MP 16-bit image is 300 MB
        img = np.right_shift(img, 8, out=img).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise InvalidImage(f"this {header.format.upper()} image has {img.dtype} samples; send 8- or 16-bit integers")
    return img


_CV_ERROR = re.compile(r"error: \([-\d]+:[^)]*\) (.*?)(?: in function '[^']*')?$", re.MULTILINE)


def _decode_error(exc: cv2.error, header: ImageHeader) -> InvalidImage | ImageTooLarge:
    """OpenCV's reason (without its source paths) as one of ours: its size caps (pixel count,
    tile buffer) are ``ImageTooLarge``, anything else ``InvalidImage``."""
    found = _CV_ERROR.search(str(exc))
    reason = found.group(1).strip() if found else "decoder error"
    if any(word in reason.lower() for word in ("max_image", "too large", "exceeds", "max_tile")):
        return ImageTooLarge(f"OpenCV refused this {header.format.upper()} image as too large ({reason})")
    return InvalidImage(f"cannot decode this {header.format.upper()} image ({reason})")
