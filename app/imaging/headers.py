"""What an image is and how large it is, read from its first bytes, before any pixel is decoded."""

from __future__ import annotations

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
