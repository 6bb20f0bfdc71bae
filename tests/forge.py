"""Hand-made image files: decompression bombs and header variants that encoders do not write.

Shared by the imaging and the API tests through the ``forge`` fixture (tests/conftest.py).
Each function returns the bytes of one file; those marked *real* decode to what they declare.
"""

from __future__ import annotations

import struct
import zlib


# --- PNG ------------------------------------------------------------------------------------
def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def png(width: int, height: int, *, bits: int = 8, color: int = 2, rows: int | None = None,
        before_idat: tuple[bytes, ...] = ()) -> bytes:
    """A PNG of zero-valued scanlines. *Real* when ``rows`` is None (all rows present); otherwise
    only the first ``rows`` rows are stored (enough for a header test, cheap to build at any size)."""
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color]
    row = 1 + (width * channels * bits + 7) // 8
    stored = height if rows is None else rows
    idat = zlib.compress(b"\x00" * (row * stored), 9)
    chunks = [png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bits, color, 0, 0, 0))]
    if color == 3:
        chunks.append(png_chunk(b"PLTE", b"\x00\x00\x00" * 2))
    chunks += list(before_idat)
    chunks += [png_chunk(b"IDAT", idat), png_chunk(b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


def png_inflating_to(width: int, height: int, inflated: int) -> bytes:
    """*Real* header, RGB: compressed scanlines that inflate to ``inflated`` bytes, however
    few the image holds (libpng inflates them all, past its last row)."""
    idat = zlib.compress(b"\x00" * inflated, 9)
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + ihdr + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def apng_chunks(width: int, height: int, x: int = 0, y: int = 0) -> tuple[bytes, bytes]:
    """acTL (one frame) and an fcTL for frame 0 of the given size and offset."""
    actl = png_chunk(b"acTL", struct.pack(">II", 1, 0))
    fctl = png_chunk(b"fcTL", struct.pack(">IIIIIHHBB", 0, width, height, x, y, 1, 10, 0, 0))
    return actl, fctl


# --- BMP ------------------------------------------------------------------------------------
def bmp_rle8(width: int, height: int) -> bytes:
    """*Real*: an 8-bit RLE BMP whose data is one end-of-bitmap code (the decoder fills the rest);
    about 1 KB for any size."""
    palette = b"\x00\x00\x00\x00" * 256
    pixels = b"\x00\x01"
    offset = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(pixels), 2835, 2835, 256, 0)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + info + palette + pixels


def bmp(width: int, height: int, *, header_size: int = 40, bpp: int = 24, rows: int | None = None) -> bytes:
    """An uncompressed BMP with any DIB header size (12 = the 16-bit core header; 40, 52, 56,
    64, 108, 124 = INFO and its successors); a negative height stores rows top-down. *Real*
    when ``rows`` is None (every row stored), else only that many rows follow the header."""
    stride = ((abs(width) * bpp + 31) // 32) * 4
    pixels = b"\x00" * (stride * (abs(height) if rows is None else rows))
    palette = b"\x00\x00\x00\x00" * (1 << bpp) if bpp <= 8 else b""
    if header_size == 12:
        palette = b"\x00\x00\x00" * (1 << bpp) if bpp <= 8 else b""
        info = struct.pack("<IHHHH", 12, width, height, 1, bpp)
    else:
        info = struct.pack("<IiiHHIIiiII", header_size, width, height, 1, bpp, 0, len(pixels), 2835, 2835, 0, 0)
        info += b"\x00" * (header_size - 40)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + info + palette + pixels


# --- TIFF -----------------------------------------------------------------------------------
_SHORT, _LONG, _LONG8 = 3, 4, 16


def tiff(width: int, height: int, *, bits: int = 8, spp: int = 3, compression: int = 1,
         sample_format: int | None = None, tile: tuple[int, int] | None = None,
         rows_per_strip: int | None = None, strip: bytes | None = None, big_endian: bool = False,
         bigtiff: bool = False, pages: int = 1) -> bytes:
    """A TIFF with one strip per page, or tiles that all share one block of data. *Real* when
    ``strip`` is None: zero samples, uncompressed. ``pages`` repeats the directory (a multi-page
    file)."""
    end = ">" if big_endian else "<"
    photometric = 2 if spp >= 3 else (0 if compression in (3, 4) else 1)
    tiles = 1
    if tile:
        tiles = -(-width // tile[0]) * -(-height // tile[1])
        if strip is None:
            strip = b"\x00" * (((tile[0] * spp * bits + 7) // 8) * tile[1])
    elif strip is None:
        strip = b"\x00" * (((width * spp * bits + 7) // 8) * height)
    off_fmt, count_fmt, entry_size, head = ("Q", "Q", 20, 16) if bigtiff else ("I", "H", 12, 8)
    out = bytearray(b"\x00" * head)
    out[:2] = b"MM" if big_endian else b"II"
    data_at = len(out)
    out += strip
    ifd_offsets: list[int] = []
    for page in range(pages):
        extra = bytearray()
        entries = [(256, _LONG, [width]), (257, _LONG, [height]), (258, _SHORT, [bits] * spp),
                   (259, _SHORT, [compression]), (262, _SHORT, [photometric]), (277, _SHORT, [spp])]
        if tile:
            entries += [(322, _LONG, [tile[0]]), (323, _LONG, [tile[1]]),
                        (324, _LONG8 if bigtiff else _LONG, [data_at] * tiles), (325, _LONG, [len(strip)] * tiles)]
        else:
            entries += [(273, _LONG8 if bigtiff else _LONG, [data_at]), (279, _LONG, [len(strip)]),
                        (278, _LONG, [rows_per_strip or height])]
        if sample_format is not None:
            entries.append((339, _SHORT, [sample_format] * spp))
        entries.sort()
        ifd_at = len(out)
        ifd_offsets.append(ifd_at)
        body_size = struct.calcsize(end + count_fmt) + entry_size * len(entries) + struct.calcsize(end + off_fmt)
        extra_at = ifd_at + body_size
        ifd = bytearray(struct.pack(end + count_fmt, len(entries)))
        for tag, kind, values in entries:
            fmt = {_SHORT: "H", _LONG: "I", _LONG8: "Q"}[kind]
            packed = struct.pack(end + fmt * len(values), *values)
            slot = struct.calcsize(off_fmt)
            if len(packed) > slot:
                ref = struct.pack(end + off_fmt, extra_at + len(extra))
                extra += packed
                packed = ref
            ifd += struct.pack(end + "HH" + ("Q" if bigtiff else "I"), tag, kind, len(values)) + packed.ljust(slot, b"\x00")
        ifd += struct.pack(end + off_fmt, 0)
        out += ifd + extra
        if page > 0:  # link the previous directory to this one
            prev = ifd_offsets[page - 1]
            prev_next = prev + struct.calcsize(end + count_fmt) + entry_size * len(entries)
            out[prev_next : prev_next + struct.calcsize(off_fmt)] = struct.pack(end + off_fmt, ifd_at)
    if bigtiff:
        out[2:8] = struct.pack(end + "HHH", 43, 8, 0)
        out[8:16] = struct.pack(end + "Q", ifd_offsets[0])
    else:
        out[2:4] = struct.pack(end + "H", 42)
        out[4:8] = struct.pack(end + "I", ifd_offsets[0])
    return bytes(out)


def tiff_g4_white(width: int, height: int) -> bytes:
    """*Real*: a CCITT Group 4 bilevel TIFF of white rows. Against a white reference line each
    row codes as one V0 bit, so 30,000 × 30,000 pixels take under 4 KB."""
    rows = b"\xff" * ((height + 7) // 8)
    eofb = b"\x00\x10\x01"  # 000000000001 000000000001, padded
    return tiff(width, height, bits=1, spp=1, compression=4, strip=rows + eofb)


# --- WebP -----------------------------------------------------------------------------------
def riff_webp(*chunks: bytes) -> bytes:
    body = b"WEBP" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def webp_chunk(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("<I", len(body)) + body + (b"\x00" if len(body) % 2 else b"")


def vp8l(width: int, height: int, payload: bytes = b"\x00" * 16) -> bytes:
    """A VP8L chunk declaring width × height (the bitstream after the header is arbitrary)."""
    return webp_chunk(b"VP8L", b"\x2f" + struct.pack("<I", (width - 1) | (height - 1) << 14) + payload)


def vp8(width: int, height: int, payload: bytes = b"\x00" * 16) -> bytes:
    """A lossy VP8 key-frame chunk declaring width × height."""
    return webp_chunk(b"VP8 ", b"\x10\x02\x00\x9d\x01\x2a" + struct.pack("<HH", width, height) + payload)


def vp8x(width: int, height: int, flags: int = 0) -> bytes:
    return webp_chunk(b"VP8X", bytes([flags, 0, 0, 0]) + (width - 1).to_bytes(3, "little")
                      + (height - 1).to_bytes(3, "little"))


# --- JPEG -----------------------------------------------------------------------------------
def jpeg_sof(jpeg: bytes) -> int:
    """The offset of the first SOFn marker of a well-formed JPEG."""
    i = 2
    while i < len(jpeg):
        marker, length = jpeg[i + 1], int.from_bytes(jpeg[i + 2 : i + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return i
        i += 2 + length
    raise AssertionError("no SOF marker")


def jpeg_with_size(jpeg: bytes, width: int, height: int, *, fill: int = 0, garbage: bytes = b"") -> bytes:
    """The same JPEG with its SOF declaring another size; ``fill`` 0xFF bytes and ``garbage``
    (bytes libjpeg skips with a warning) placed before the SOF marker."""
    i = jpeg_sof(jpeg)
    sof = jpeg[i : i + 5] + struct.pack(">HH", height, width)
    return jpeg[:i] + garbage + b"\xff" * fill + sof + jpeg[i + 9 :]


def jpeg_with_scans(progressive: bytes, scans: int) -> bytes:
    """A progressive JPEG with its last scan repeated until it has ``scans`` (each decoded over
    the whole image)."""
    last = progressive.rindex(b"\xff\xda")
    end = progressive.rindex(b"\xff\xd9")
    extra = scans - progressive.count(b"\xff\xda")
    return progressive[:end] + progressive[last:end] * extra + progressive[end:]


# --- broken JPEGs: the corpus both decode paths must refuse (or accept) alike ----------------
def jpeg_segments(jpeg: bytes) -> list[tuple[int, int, int]]:
    """``(offset, marker, end)`` of each marker up to the first scan's data (end: where the
    segment ends), then the first SOS; the entropy-coded data is not walked."""
    out, i = [], 2
    while i < len(jpeg):
        marker = jpeg[i + 1]
        length = int.from_bytes(jpeg[i + 2 : i + 4], "big")
        out.append((i, marker, i + 2 + length))
        if marker == 0xDA:
            return out
        i += 2 + length
    raise AssertionError("no SOS marker")


def jpeg_markers(jpeg: bytes) -> list[tuple[int, int]]:
    """``(offset, marker)`` of every marker after the first SOS header (RSTn, DHT, SOS, EOI...)."""
    start = jpeg_segments(jpeg)[-1][2]
    out, i = [], jpeg.find(b"\xff", start)
    while i >= 0 and i + 1 < len(jpeg):
        if jpeg[i + 1] not in (0x00, 0xFF):
            out.append((i, jpeg[i + 1]))
        i = jpeg.find(b"\xff", i + 1)
    return out


def jpeg_without(jpeg: bytes, marker: int, which: int | None = None) -> bytes:
    """The JPEG without its header segments of ``marker`` (all of them, or the ``which``-th)."""
    found = [(a, b) for a, m, b in jpeg_segments(jpeg) if m == marker]
    if which is not None:
        found = [found[which]]
    for a, b in reversed(found):
        jpeg = jpeg[:a] + jpeg[b:]
    return jpeg


def jpeg_scan_data(jpeg: bytes) -> tuple[int, int]:
    """``(start, end)`` of the first scan's entropy-coded data."""
    start = jpeg_segments(jpeg)[-1][2]
    end = next(i for i, m in jpeg_markers(jpeg) if not 0xD0 <= m <= 0xD7)
    return start, end


def jpeg_bit_flips(jpeg: bytes, seed: int, count: int = 1) -> bytes:
    """``count`` random bits flipped inside the first scan's data, never creating a marker."""
    import random

    rng = random.Random(seed)
    start, end = jpeg_scan_data(jpeg)
    out = bytearray(jpeg)
    flipped = 0
    while flipped < count:
        i, bit = rng.randrange(start, end), 1 << rng.randrange(8)
        if out[i] == 0xFF or out[i] ^ bit == 0xFF or out[i - 1] == 0xFF:
            continue  # keep the marker structure: the corruption is in the Huffman-coded data only
        out[i] ^= bit
        flipped += 1
    return bytes(out)


def jpeg_with_dri(jpeg: bytes, interval: int) -> bytes:
    """A DRI segment inserted before the frame, without adding a restart marker to the data."""
    sof = jpeg_sof(jpeg)
    return jpeg[:sof] + b"\xff\xdd\x00\x04" + interval.to_bytes(2, "big") + jpeg[sof:]


def jpeg_broken(name: str, jpeg: bytes) -> dict[str, bytes]:
    """Every broken variant of one well-formed JPEG, by name."""
    n = len(jpeg)
    segments = jpeg_segments(jpeg)
    markers = jpeg_markers(jpeg)
    sos_at, _, data_at = segments[-1]
    out = {f"{name}_cut_400": jpeg[:400], f"{name}_cut_2000": jpeg[:2000], f"{name}_cut_half": jpeg[: n // 2],
           f"{name}_cut_90pct": jpeg[: n * 9 // 10], f"{name}_no_eoi": jpeg[:-2], f"{name}_cut_last_byte": jpeg[:-1],
           f"{name}_cut_before_sos": jpeg[:sos_at], f"{name}_cut_after_sos": jpeg[:data_at],
           f"{name}_zero_length_scan": jpeg[:data_at] + b"\xff\xd9",
           f"{name}_eoi_only_after_header": jpeg[:sos_at] + b"\xff\xd9",
           f"{name}_half_then_eoi": jpeg[: max(data_at + 1, n // 2)].rstrip(b"\xff") + b"\xff\xd9",
           f"{name}_trailing_garbage": jpeg + b"garbage after the EOI" * 10,
           f"{name}_garbage_before_eoi": jpeg[:-2] + b"\x00" * 64 + b"\xff\xd9",
           f"{name}_no_dht": jpeg_without(jpeg, 0xC4), f"{name}_no_dqt": jpeg_without(jpeg, 0xDB),
           f"{name}_second_soi": jpeg[:2] + b"\xff\xd8" + jpeg[2:],
           f"{name}_garbage_between_segments": jpeg[:sos_at] + b"junk" + jpeg[sos_at:],
           f"{name}_unknown_marker_before_scan": jpeg[:sos_at] + b"\xff\x02\x00\x04ab" + jpeg[sos_at:],
           f"{name}_second_sof": jpeg[:sos_at] + jpeg[jpeg_sof(jpeg) : next(b for a, m, b in segments
                                                                         if a == jpeg_sof(jpeg))] + jpeg[sos_at:],
           f"{name}_scan_of_unknown_component": jpeg[: sos_at + 5] + b"\x63" + jpeg[sos_at + 6 :],
           f"{name}_hierarchical_sof": jpeg[: jpeg_sof(jpeg) + 1] + b"\xc5" + jpeg[jpeg_sof(jpeg) + 2 :],
           # Ss, Se, Ah/Al of the first scan zeroed (files like it exist: libjpeg warns and ignores them)
           f"{name}_sos_parameters_zeroed": jpeg[: data_at - 3] + b"\x00\x00\x00" + jpeg[data_at:]}
    for pct in range(1, 100):
        out[f"{name}_cut_{pct:02d}pct"] = jpeg[: n * pct // 100]
    for seed in range(12):
        out[f"{name}_bit_flip_{seed}"] = jpeg_bit_flips(jpeg, seed)
        out[f"{name}_bit_flips_{seed}x8"] = jpeg_bit_flips(jpeg, 1000 + seed, 8)
    import random

    rng = random.Random(len(jpeg))
    for k in range(24):  # one header byte (a length, a table entry, a scan parameter...) changed
        at = rng.randrange(2, data_at)
        out[f"{name}_header_byte_{k}"] = jpeg[:at] + bytes([jpeg[at] ^ rng.randrange(1, 256)]) + jpeg[at + 1 :]
    dqt = next(a for a, m, _ in segments if m == 0xDB)  # its first table declared 16-bit: too short
    out[f"{name}_dqt_16_bit_short"] = jpeg[: dqt + 4] + bytes([jpeg[dqt + 4] | 0x10]) + jpeg[dqt + 5 :]
    dhts = [(a, b) for a, m, b in segments if m == 0xC4]
    for k, (a, b) in enumerate(dhts):
        out[f"{name}_dht_{k}_removed"] = jpeg[:a] + jpeg[b:]
        over = bytearray(jpeg[a:b])  # the first table's codes: two of 1 bit (all ones), the rest of 16
        total = sum(over[5:21])
        over[5:21] = bytes([2] + [0] * 14 + [total - 2])
        out[f"{name}_dht_{k}_oversubscribed"] = jpeg[:a] + bytes(over) + jpeg[b:]
        moved = bytearray(jpeg[a:b])
        moved[4] = (moved[4] & 0x10) | 3  # the table defined as table 3: the scan's table is missing
        out[f"{name}_dht_{k}_wrong_index"] = jpeg[:a] + bytes(moved) + jpeg[b:]
    rsts = [i for i, m in markers if 0xD0 <= m <= 0xD7]
    if rsts:
        r = rsts[len(rsts) // 2]
        out[f"{name}_rst_removed"] = jpeg[:r] + jpeg[r + 2 :]
        out[f"{name}_rst_out_of_order"] = jpeg[: r + 1] + bytes([0xD0 + (jpeg[r + 1] - 0xD0 + 3) % 8]) + jpeg[r + 2 :]
        out[f"{name}_rst_doubled"] = jpeg[: r + 2] + jpeg[r : r + 2] + jpeg[r + 2 :]
        out[f"{name}_no_rst_markers"] = _without_rst(jpeg, rsts)
        out[f"{name}_no_dri"] = jpeg_without(jpeg, 0xDD)
    else:
        out[f"{name}_dri_without_rst"] = jpeg_with_dri(jpeg, 4)
    scans = [i for i, m in markers if m == 0xDA]
    if scans:  # progressive (or multi-scan): cut at each later scan, with and without an EOI
        for k, at in enumerate(scans):
            out[f"{name}_cut_at_scan_{k + 2}"] = jpeg[:at]
            out[f"{name}_scans_1_to_{k + 1}_then_eoi"] = jpeg[:at] + b"\xff\xd9"
        last = scans[-1]
        out[f"{name}_last_scan_repeated"] = jpeg[:-2] + jpeg[last:-2] + b"\xff\xd9"
        out[f"{name}_second_scan_dropped"] = jpeg[: scans[0]] + jpeg[scans[1] if len(scans) > 1 else -2 :]
    return out


def _without_rst(jpeg: bytes, rsts: list[int]) -> bytes:
    for r in reversed(rsts):
        jpeg = jpeg[:r] + jpeg[r + 2 :]
    return jpeg
