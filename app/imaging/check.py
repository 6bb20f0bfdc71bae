"""What is decided about an image before a pixel is decoded: a format we accept, a readable
header, pixels, decode memory and decode work within the limits, and (a JPEG) a whole byte
structure. No OpenCV here: the HTTP workers check every image with it and never decode one."""

from __future__ import annotations

from app.config import MAX_DECODE_BYTES, MAX_JPEG_SCANS, MAX_PIXELS
from app.errors import ImageTooLarge, InvalidImage
from app.imaging.headers import ImageHeader, read_header


def decode_bytes(header: ImageHeader) -> int:
    """An estimate of the memory one decode holds at its peak: ``imdecode`` holds the BGR
    image twice; a 16-bit TIFF, read at its depth to match Ultralytics, at 2 bytes a sample;
    plus the decoder's own buffers (TIFF tiles and strips, WebP/APNG canvases).

    Measured (bench/results/2026-11-30-cpu-decode-memory.json, 49 MP): +303 MB for JPEG
    (baseline, progressive), PNG (1-bit to 16-bit RGBA), BMP RLE8, WebP and 8-bit TIFF against
    294 MB estimated; +597 MB for a 16-bit TIFF against 588 MB. Within 3 %, and the budget
    below has more room than that.
    """
    sample_bytes = 2 if header.format == "tiff" and header.bits > 8 else 1
    return 2 * header.pixels * 3 * sample_bytes + header.work_bytes


def check_image(
    data: bytes, *, max_pixels: int = MAX_PIXELS, max_decode_bytes: int = MAX_DECODE_BYTES
) -> ImageHeader:
    """Everything decided before a pixel is decoded: a format we accept, a readable header, a
    pixel count and a decode memory estimate within the limits. Returns the header."""
    if not data:
        raise InvalidImage("empty image")
    header = read_header(data)
    if header.pixels > max_pixels:
        raise ImageTooLarge(
            f"image is {header.width:,} × {header.height:,} = {header.pixels:,} pixels, the limit is {max_pixels:,}"
        )
    need = decode_bytes(header)
    if need > max_decode_bytes:
        raise ImageTooLarge(
            f"decoding this {header.format.upper()} ({header.width:,} × {header.height:,}, {header.channels} × "
            f"{header.bits}-bit samples) would need about {need / 2**20:,.0f} MiB, the limit is "
            f"{max_decode_bytes / 2**20:,.0f} MiB"
        )
    if header.jpeg is not None and header.jpeg.scans > MAX_JPEG_SCANS:
        # Each scan of a progressive JPEG is decoded over the whole image.
        raise ImageTooLarge(f"this JPEG has {header.jpeg.scans:,} scans, the limit is {MAX_JPEG_SCANS}")
    check_whole(header)
    return header


def check_whole(header: ImageHeader) -> None:
    """A JPEG whose byte structure is not whole (``app.imaging.jpeg_structure``) is refused as
    OpenCV refuses what it cannot decode, on every decode path."""
    if header.jpeg is not None and header.jpeg.defect is not None:
        raise undecodable(header.format)


def undecodable(fmt: str) -> InvalidImage:
    """The one error for an image that is truncated or corrupt, whichever decoder found it."""
    return InvalidImage(f"cannot decode this {fmt.upper()} image (truncated or corrupt)")
