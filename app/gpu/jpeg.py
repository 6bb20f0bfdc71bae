"""What a JPEG is, read from its markers before any pixel is decoded: size, components,
precision, coding (baseline, progressive, arithmetic, lossless), chroma sampling and the EXIF
orientation.

The GPU decoders take the usual JPEGs (8-bit, one or three components, Huffman coded); the
rest (CMYK/YCCK, 12-bit, arithmetic, lossless) go to OpenCV, which is what Ultralytics reads
with, so those come out exactly as Ultralytics sees them. Pure Python: no GPU library needed.
"""

from __future__ import annotations

from dataclasses import dataclass

_SOI = b"\xff\xd8"
_EXIF_ORIENTATION_TAG = 0x0112
_NO_LENGTH = {0x01, *range(0xD0, 0xD8)}  # TEM and RSTn carry no length field
_SOF_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}
_SOF_LOSSLESS = {0xC3, 0xC7, 0xCB, 0xCF}
_SOF_ARITHMETIC = {0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


@dataclass(frozen=True)
class JpegHeader:
    height: int
    width: int
    components: int
    precision: int  # bits per sample
    progressive: bool
    arithmetic: bool
    lossless: bool
    sampling: tuple[tuple[int, int], ...]  # (horizontal, vertical) factor per component
    orientation: int = 1  # EXIF orientation 1..8

    @property
    def gpu_decodable(self) -> bool:
        """8-bit, gray or three-component, Huffman-coded, not lossless: the GPU decoders' ground."""
        return self.precision == 8 and self.components in (1, 3) and not (self.arithmetic or self.lossless)


def read_jpeg_header(data: bytes) -> JpegHeader | None:
    """The frame header (and EXIF orientation) of a JPEG; None if it is not one or is cut short."""
    if not data.startswith(_SOI):
        return None
    i, n, orientation = 2, len(data), 1
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _NO_LENGTH:
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image / start of scan before any frame header
            return None
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        segment = data[i + 4 : i + 2 + length]
        if marker == 0xE1 and segment[:6] == b"Exif\x00\x00":
            orientation = _tiff_orientation(segment[6:])
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if len(segment) < 6:
                return None
            count = segment[5]
            comps = segment[6 : 6 + 3 * count]
            if len(comps) < 3 * count:
                return None
            return JpegHeader(
                height=int.from_bytes(segment[1:3], "big"),
                width=int.from_bytes(segment[3:5], "big"),
                components=count,
                precision=segment[0],
                progressive=marker in _SOF_PROGRESSIVE,
                arithmetic=marker in _SOF_ARITHMETIC,
                lossless=marker in _SOF_LOSSLESS,
                sampling=tuple((comps[3 * k + 1] >> 4, comps[3 * k + 1] & 0x0F) for k in range(count)),
                orientation=orientation,
            )
        i += 2 + length
    return None


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
