"""What an image is and how large it is, read from its header, before any pixel is decoded.

Every format we accept (JPEG, PNG, BMP, TIFF, WebP) has a parser here that reads the size the
decoder (OpenCV: libjpeg-turbo, libpng, its own BMP reader, libtiff, libwebp) will allocate
for, the way that decoder reads it: libjpeg skips fill bytes and garbage before a marker, so
do we; OpenCV reads BMP heights as signed and TIFF's first directory only, so do we. A header
we cannot read is refused (``InvalidImage``) rather than handed to a decoder whose size we do
not know: that is what keeps a 1 KB file from allocating gigabytes. Work a header cannot
show is bounded here too: a PNG whose compressed data inflates past what its size can hold
is refused (inflating stops there), and a JPEG's scans are counted. A JPEG's whole byte
structure is walked too (``app.imaging.jpeg_structure``): its header says whether the bytes
can decode whole, for every decoder that is handed them with it.

This is the one JPEG header parser: besides the size, it reads what a GPU decoder needs to
know (coding, precision, components, chroma sampling, EXIF orientation). Pure Python, no
OpenCV: the HTTP workers size images with it.
"""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass

from app.config import MAX_JPEG_SCANS
from app.errors import InvalidImage, UnsupportedMediaType, YolopipeError
from app.imaging.jpeg_structure import JpegStructure, walk_jpeg

_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"II+\x00", "tiff"),  # BigTIFF
    (b"MM\x00+", "tiff"),
    (b"RIFF", "webp"),
)


@dataclass(frozen=True)
class JpegHeader:
    """What a JPEG's markers say before its first scan, how many scans follow, and whether its
    byte structure is whole (``app.imaging.jpeg_structure``: every JPEG header is read with
    that walk, so whoever holds a header knows it)."""

    height: int
    width: int
    components: int
    precision: int  # bits per sample
    progressive: bool
    arithmetic: bool
    lossless: bool
    sampling: tuple[tuple[int, int], ...]  # (horizontal, vertical) factor per component
    orientation: int = 1  # EXIF orientation 1..8
    scans: int = 1  # SOS markers from the frame header on (an EXIF thumbnail's come before it)
    defect: str | None = None  # why the bytes cannot decode whole (truncated, corrupt); None: they can
    needs_libjpeg: bool = False  # it leans on a libjpeg leniency (Huffman tables it never defines, ...)

    @property
    def gpu_decodable(self) -> bool:
        """8-bit, gray or three-component, Huffman-coded, not lossless, and nothing only libjpeg
        reads as meant: the GPU decoders' ground."""
        return self.precision == 8 and self.components in (1, 3) and not (
            self.arithmetic or self.lossless or self.needs_libjpeg)


@dataclass(frozen=True)
class ImageHeader:
    """The size and sample layout an image declares."""

    format: str
    height: int
    width: int
    channels: int  # samples per pixel as stored (a palette index counts as one)
    bits: int  # bits per sample as stored
    work_bytes: int = 0  # decoder buffers besides the image itself (TIFF tiles, APNG canvases, BGRA staging)
    jpeg: JpegHeader | None = None  # a JPEG's own facts

    @property
    def pixels(self) -> int:
        return self.height * self.width

    @property
    def upright_size(self) -> tuple[int, int]:
        """``(height, width)`` as decoded: a JPEG's EXIF orientation 5-8 turns it by 90°, as
        OpenCV's read (and every GPU decoder here) applies it."""
        if self.jpeg is not None and self.jpeg.orientation in (5, 6, 7, 8):
            return self.width, self.height
        return self.height, self.width

    @functools.cached_property  # asked per image served, of headers the IPC reader hands out again and again
    def gpu_decodable(self) -> bool:
        """Whether a GPU JPEG decoder takes this image: the one test of it (``JpegHeader``'s),
        for the detector's routing and the GPU decoders' alike."""
        return self.jpeg is not None and self.jpeg.gpu_decodable


# File suffixes of the formats read_header accepts: what a folder of images is listed by.
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".png", ".bmp", ".dib", ".tif", ".tiff", ".webp"})


def sniff_format(data: bytes) -> str | None:
    """The image format named by the first bytes, or None when it is not one we decode."""
    for magic, name in _SIGNATURES:
        if data.startswith(magic):
            if name == "webp" and data[8:12] != b"WEBP":
                return None
            return name
    return None


def read_header(data: bytes) -> ImageHeader:
    """The header of an image in a format we accept.

    Raises ``UnsupportedMediaType`` for anything else (or a variant we refuse, such as a
    floating-point TIFF) and ``InvalidImage`` for a header that is truncated or inconsistent.
    """
    fmt = sniff_format(data)
    if fmt is None:
        raise UnsupportedMediaType("not an image in a supported format (JPEG, PNG, BMP, TIFF, WebP)")
    try:
        header = _PARSERS[fmt](data)
    except (IndexError, struct.error):  # a read past the end of the bytes
        header = None
    if header is None or header.height <= 0 or header.width <= 0:
        raise InvalidImage(f"cannot read the size of this {fmt.upper()} image (truncated or corrupt header)")
    return header


def read_jpeg_header(data: bytes) -> JpegHeader | None:
    """A JPEG's facts; None when ``data`` is not a JPEG whose header we can read."""
    try:
        return read_header(data).jpeg
    except YolopipeError:
        return None


# --- JPEG -----------------------------------------------------------------------------------
# Start-of-frame markers of every coding process (baseline, extended, progressive, lossless,
# hierarchical, arithmetic); C4 (DHT), C8 (JPG) and CC (DAC) share the range but are not frames.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn, TEM: markers without a length
# What libjpeg accepts before a frame (DHT, DAC, DQT, DNL, DRI, APPn, COM); any other marker is
# its "unsupported marker" error. Refusing them here keeps a PNG behind an SOI from being misread.
_BEFORE_FRAME = frozenset({0xC4, 0xCC, 0xDB, 0xDC, 0xDD, 0xFE, *range(0xE0, 0xF0)}) | _STANDALONE
_SOF_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_SOF_LOSSLESS = frozenset({0xC3, 0xC7, 0xCB, 0xCF})
_SOF_ARITHMETIC = frozenset({0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_EXIF_ORIENTATION_TAG = 0x0112


def _jpeg(data: bytes) -> ImageHeader | None:
    """Walk the markers up to the first SOFn: any number of 0xFF fill bytes may precede a
    marker. libjpeg's ``next_marker`` also skips other bytes before one (with a warning); we
    refuse them: a body that is something else behind an SOI (a PNG) is not read as a JPEG
    whose size some byte pattern in it declares."""
    if data[:2] != b"\xff\xd8":
        return None
    n, i, orientation = len(data), 2, 1
    while True:
        if i >= n or data[i] != 0xFF:  # not a marker where the last segment ended
            return None
        k = i + 1
        while k < n and data[k] == 0xFF:
            k += 1
        if k >= n:
            return None
        marker, i = data[k], k + 1
        if marker in _SOF:
            length, bits, height, width, comps = struct.unpack_from(">HBHHB", data, i)
            if length < 8 + 3 * comps or comps == 0 or i + length > n:
                return None
            factors = data[i + 8 : i + 8 + 3 * comps]
            structure = walk_jpeg(data, max_scans=MAX_JPEG_SCANS)
            facts = JpegHeader(height, width, comps, bits, progressive=marker in _SOF_PROGRESSIVE,
                               arithmetic=marker in _SOF_ARITHMETIC, lossless=marker in _SOF_LOSSLESS,
                               sampling=tuple([(hv >> 4, hv & 0x0F) for hv in factors[1::3]]),
                               orientation=orientation, scans=_scans(data, i, structure),
                               defect=structure.defect, needs_libjpeg=structure.needs_libjpeg)
            return ImageHeader("jpeg", height, width, comps, bits, jpeg=facts)
        if marker not in _BEFORE_FRAME:  # a second SOI, EOI, a scan before any frame, an unknown marker
            return None
        if marker not in _STANDALONE:
            length = data[i] << 8 | data[i + 1]
            if length < 2:
                return None
            if marker == 0xE1 and data[i + 2 : i + 8] == b"Exif\x00\x00":
                orientation = _exif_orientation(data[i + 8 : i + length])
            i += length


def _scans(data: bytes, start: int, structure: JpegStructure) -> int:
    """The scans the structure walk counted; where it stopped early (a defect, or more scans
    than ``MAX_JPEG_SCANS``: each scan of a progressive JPEG is decoded over the whole image,
    the decode-time bomb that limit bounds) every SOS marker from the frame header on."""
    if structure.defect is None and structure.scans <= MAX_JPEG_SCANS:
        return structure.scans
    return data.count(b"\xff\xda", start)


def _exif_orientation(tiff: bytes) -> int:
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


# --- PNG ------------------------------------------------------------------------------------
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type → samples per pixel
_PNG_MAX_CHUNKS_BEFORE_IDAT = 10_000


def _png(data: bytes) -> ImageHeader | None:
    length, kind, width, height, bits, color = struct.unpack_from(">I4sIIBB", data, 8)
    if length != 13 or kind != b"IHDR" or color not in _PNG_CHANNELS or width >= 2**31 or height >= 2**31:
        return None
    if bits not in (1, 2, 4, 8, 16):
        return None
    # APNG: OpenCV composes frames on canvases of the full size; frame 0 (read by imdecode) must
    # fit the canvas. acTL and the first fcTL come before the first IDAT.
    work, i = 0, 8
    for _ in range(_PNG_MAX_CHUNKS_BEFORE_IDAT):
        length, kind = struct.unpack_from(">I4s", data, i)
        if kind == b"IDAT":
            _check_png_inflates_within(data, i, width, height, _PNG_CHANNELS[color] * bits, interlaced=data[28] == 1)
            return ImageHeader("png", height, width, _PNG_CHANNELS[color], bits, work)
        if kind == b"acTL":
            work = 2 * height * width * 4  # the RGBA canvas and the frame being composed on it
        if kind == b"fcTL":
            fw, fh, fx, fy = struct.unpack_from(">IIII", data, i + 12)
            if fx + fw > width or fy + fh > height:
                return None
        i += 12 + length
    return None


_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _png_raw_bytes(width: int, height: int, pixel_bits: int, interlaced: bool) -> int:
    """The filtered scanlines of the image: what its compressed data inflates to."""
    passes = _ADAM7 if interlaced else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        w, h = max(0, (width - x0 + dx - 1) // dx), max(0, (height - y0 + dy - 1) // dy)
        if w and h:
            total += h * (1 + (w * pixel_bits + 7) // 8)
    return total


def _check_png_inflates_within(data: bytes, i: int, width: int, height: int, pixel_bits: int, *,
                               interlaced: bool) -> None:
    """libpng inflates every IDAT byte, also past the last row: a 1 × 1 image with 4 MB of
    compressed data inflated 4 GiB for 13 s. Inflate here, stopping just past what the image
    can hold (so the cost is at most that of a real image of this size)."""
    raw = _png_raw_bytes(width, height, pixel_bits, interlaced)
    inflater, produced, view = zlib.decompressobj(), 0, memoryview(data)
    step = 1 << 20
    while i + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, i)
        if kind != b"IDAT":
            break
        pending = view[i + 8 : i + 8 + length]
        while pending and produced <= raw and not inflater.eof:
            try:
                produced += len(inflater.decompress(pending, min(step, raw + 1 - produced)))
            except zlib.error:
                return  # a corrupt stream: libpng stops at the error, OpenCV reports it
            pending = inflater.unconsumed_tail
        if produced > raw:
            raise InvalidImage(f"this PNG's compressed data inflates to more than its {width:,} × {height:,} "
                               f"pixels can hold ({raw:,} bytes)")
        if inflater.eof:
            return
        i += 12 + length


# --- BMP ------------------------------------------------------------------------------------
def _bmp(data: bytes) -> ImageHeader | None:
    """OpenCV's reader: a 12-byte core header has 16-bit sizes; any header of 36 bytes or more
    (INFO, V2–V5, OS/2 v2) has signed 32-bit ones, a negative height meaning top-down rows."""
    (size,) = struct.unpack_from("<I", data, 14)
    if size == 12:
        width, height, _, bpp = struct.unpack_from("<HHHH", data, 18)
    elif size >= 36:
        width, height, _, bpp = struct.unpack_from("<iiHH", data, 18)
        height = abs(height)
    else:
        return None
    # 32-bit images with bit fields decode through a BGRA image first.
    return ImageHeader("bmp", height, width, 1, bpp, height * width * 4 if bpp == 32 else 0)


# --- TIFF -----------------------------------------------------------------------------------
_TIFF_TYPES = {1: "B", 3: "H", 4: "I", 16: "Q"}  # BYTE, SHORT, LONG, LONG8
# ImageWidth, ImageLength, BitsPerSample, RowsPerStrip, SamplesPerPixel, TileWidth, TileLength, SampleFormat
_TIFF_LAYOUT_TAGS = frozenset({256, 257, 258, 278, 277, 322, 323, 339})
_FLOAT_SAMPLES = 3  # SampleFormat: IEEE floating point (4 and up: undefined, complex)


def _tiff(data: bytes) -> ImageHeader | None:
    """The first directory (the page imdecode reads), classic or BigTIFF, either byte order."""
    end = "<" if data[:2] == b"II" else ">"
    (version,) = struct.unpack_from(end + "H", data, 2)
    if version == 43:
        offset_size, (ifd,) = 8, struct.unpack_from(end + "Q", data, 8)
        count_fmt, entry_size = "Q", 20
    else:
        offset_size, (ifd,) = 4, struct.unpack_from(end + "I", data, 4)
        count_fmt, entry_size = "H", 12
    (count,) = struct.unpack_from(end + count_fmt, data, ifd)
    tags: dict[int, int] = {}
    pos = ifd + struct.calcsize(count_fmt)
    for _ in range(count):
        tag, kind = struct.unpack_from(end + "HH", data, pos)
        (n,) = struct.unpack_from(end + ("Q" if offset_size == 8 else "I"), data, pos + 4)
        value_at = pos + 4 + offset_size
        pos += entry_size
        if tag not in _TIFF_LAYOUT_TAGS:
            continue
        # libtiff keeps the first of duplicate tags and reads signed or other types too: rather
        # than follow every such rule, refuse what a well-formed writer never produces.
        if tag in tags or kind not in _TIFF_TYPES or n == 0:
            return None
        item = struct.calcsize(_TIFF_TYPES[kind])
        if n * item > offset_size:  # the values live elsewhere; the first one is what we need
            (value_at,) = struct.unpack_from(end + ("Q" if offset_size == 8 else "I"), data, value_at)
        (tags[tag],) = struct.unpack_from(end + _TIFF_TYPES[kind], data, value_at)
    if 256 not in tags or 257 not in tags:
        return None
    width, height = tags[256], tags[257]
    spp, bits = tags.get(277, 1), tags.get(258, 1)
    if tags.get(339, 1) >= _FLOAT_SAMPLES or bits > 16:  # Ultralytics would hand these on unscaled
        kind = "floating-point" if tags.get(339, 1) >= _FLOAT_SAMPLES else f"{bits}-bit"
        raise UnsupportedMediaType(f"{kind} TIFF samples are not supported: send 8- or 16-bit integer samples")
    # OpenCV reads one tile or strip at a time into a buffer of that size (RGBA for most
    # layouts). A tile may be far larger than the image: 100 × 100 pixels in one 16,384 ×
    # 16,000 tile took 1 GB.
    if 322 in tags:
        tile_w, tile_h = tags[322], tags.get(323, height)
    else:
        tile_w, tile_h = width, min(tags.get(278, height), height)
    work = tile_w * tile_h * max(spp, 4) * max(1, (bits + 7) // 8)
    return ImageHeader("tiff", height, width, spp, bits, work)


# --- WebP -----------------------------------------------------------------------------------
def _webp(data: bytes) -> ImageHeader | None:
    """VP8 (lossy), VP8L (lossless) or VP8X (extended: the canvas; libwebp refuses a still
    image whose bitstream differs from it, and animation frames that do not fit it). libwebp
    decodes into a BGRA (or BGR) buffer that OpenCV then converts."""
    kind = data[12:16]
    if kind == b"VP8 ":
        if data[23:26] != b"\x9d\x01\x2a":
            return None
        width, height = struct.unpack_from("<HH", data, 26)
        width, height = width & 0x3FFF, height & 0x3FFF
        return ImageHeader("webp", height, width, 3, 8, height * width * 4)
    if kind == b"VP8L":
        if data[20] != 0x2F:
            return None
        (bits,) = struct.unpack_from("<I", data, 21)
        width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        return ImageHeader("webp", height, width, 4, 8, height * width * 4)
    if kind == b"VP8X":
        flags = data[20]
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        canvases = 3 if flags & 0x02 else 1  # animation: the canvas, the previous one and a frame
        return ImageHeader("webp", height, width, 4, 8, canvases * height * width * 4)
    return None


_PARSERS = {"jpeg": _jpeg, "png": _png, "bmp": _bmp, "tiff": _tiff, "webp": _webp}
