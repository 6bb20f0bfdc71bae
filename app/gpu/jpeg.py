"""EXIF orientation for GPU-decoded JPEGs. The JPEG header parser (size, components,
precision, coding, chroma sampling, orientation) is the one in ``app.imaging.headers``: the
GPU decoders take the usual JPEGs (8-bit, one or three components, Huffman coded); the rest
(CMYK/YCCK, 12-bit, arithmetic, lossless) go to OpenCV, which is what Ultralytics reads with.
"""

from __future__ import annotations

from app.imaging.headers import JpegHeader, read_jpeg_header

__all__ = ["JpegHeader", "apply_orientation", "read_jpeg_header"]


def apply_orientation(chw, orientation: int):
    """Turn a ``[C, H, W]`` tensor as EXIF ``orientation`` says (what OpenCV's ``imdecode`` does).

    For the torchvision nvJPEG fallback, which ignores EXIF; nvImageCodec applies it itself.
    """
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
