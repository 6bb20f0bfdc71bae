"""Sizes read from headers equal what OpenCV and Pillow read, for every format and variant we
accept; decompression bombs and unreadable headers are refused before any pixel is decoded."""

from __future__ import annotations

import io
import struct
import zlib

import cv2
import numpy as np
import pytest
from PIL import Image

from app.config import MAX_DECODE_BYTES
from app.errors import ImageTooLarge, InvalidImage, UnsupportedMediaType
from app.imaging.check import check_image, decode_bytes
from app.imaging.decode import decode_image
from app.imaging.headers import read_header, sniff_format


@pytest.fixture(scope="module")
def bus(assets_dir) -> np.ndarray:
    return cv2.resize(cv2.imread(str(assets_dir / "bus.jpg")), (203, 271), interpolation=cv2.INTER_AREA)


def cv(img: np.ndarray, ext: str, *params: int) -> bytes:
    ok, buf = cv2.imencode(ext, img, params)
    assert ok, ext
    return buf.tobytes()


def pil(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def rgb(bgr: np.ndarray) -> Image.Image:
    return Image.fromarray(np.ascontiguousarray(bgr[..., ::-1]))


def exif6() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return exif.tobytes()


# name → (build(forge, bus) → bytes, the suffix Ultralytics' imread would see)
VARIANTS = {
    "jpeg_baseline": (lambda f, b: cv(b, ".jpg"), ".jpg"),
    "jpeg_progressive": (lambda f, b: cv(b, ".jpg", cv2.IMWRITE_JPEG_PROGRESSIVE, 1), ".jpg"),
    "jpeg_restart_intervals": (lambda f, b: cv(b, ".jpg", cv2.IMWRITE_JPEG_RST_INTERVAL, 4), ".jpg"),
    "jpeg_gray": (lambda f, b: cv(cv2.cvtColor(b, cv2.COLOR_BGR2GRAY), ".jpg"), ".jpg"),
    "jpeg_cmyk": (lambda f, b: pil(rgb(b).convert("CMYK"), "JPEG"), ".jpg"),
    "jpeg_444": (lambda f, b: pil(rgb(b), "JPEG", subsampling=0), ".jpg"),
    "jpeg_exif_rotated": (lambda f, b: pil(rgb(b), "JPEG", exif=exif6()), ".jpg"),
    "jpeg_fill_bytes_before_sof": (lambda f, b: f.jpeg_with_size(cv(b, ".jpg"), 203, 271, fill=5), ".jpg"),
    "png_rgb": (lambda f, b: cv(b, ".png"), ".png"),
    "png_rgba": (lambda f, b: cv(cv2.cvtColor(b, cv2.COLOR_BGR2BGRA), ".png"), ".png"),
    "png_rgba_16bit": (lambda f, b: cv(cv2.cvtColor(b, cv2.COLOR_BGR2BGRA).astype(np.uint16) * 257, ".png"), ".png"),
    "png_gray_16bit": (lambda f, b: cv(cv2.cvtColor(b, cv2.COLOR_BGR2GRAY).astype(np.uint16) * 257, ".png"), ".png"),
    "png_1bit": (lambda f, b: pil(rgb(b).convert("1"), "PNG"), ".png"),
    "png_1bit_forged": (lambda f, b: f.png(203, 271, bits=1, color=0), ".png"),
    "png_2bit_gray": (lambda f, b: f.png(203, 271, bits=2, color=0), ".png"),
    "png_4bit_palette": (lambda f, b: f.png(203, 271, bits=4, color=3), ".png"),
    "png_palette": (lambda f, b: pil(rgb(b).convert("P"), "PNG"), ".png"),
    "png_gray_alpha": (lambda f, b: pil(rgb(b).convert("LA"), "PNG"), ".png"),
    "apng": (lambda f, b: pil(rgb(b), "PNG", save_all=True, append_images=[rgb(b[::-1])]), ".png"),
    "bmp_24bit": (lambda f, b: cv(b, ".bmp"), ".bmp"),
    "bmp_1bit": (lambda f, b: pil(rgb(b).convert("1"), "BMP"), ".bmp"),
    "bmp_8bit_palette": (lambda f, b: pil(rgb(b).convert("P"), "BMP"), ".bmp"),
    "bmp_32bit": (lambda f, b: pil(rgb(b).convert("RGBA"), "BMP"), ".bmp"),
    "bmp_rle8": (lambda f, b: f.bmp_rle8(203, 271), ".bmp"),
    "bmp_core_header_12": (lambda f, b: f.bmp(203, 271, header_size=12), ".bmp"),
    "bmp_v3_header_56": (lambda f, b: f.bmp(203, 271, header_size=56), ".bmp"),
    "bmp_v4_header_108": (lambda f, b: f.bmp(203, 271, header_size=108), ".bmp"),
    "bmp_v5_header_124": (lambda f, b: f.bmp(203, 271, header_size=124, bpp=8), ".bmp"),
    "bmp_top_down": (lambda f, b: f.bmp(203, -271), ".bmp"),
    "bmp_16bit": (lambda f, b: f.bmp(203, 271, bpp=16), ".bmp"),
    "tiff_lzw": (lambda f, b: cv(b, ".tiff"), ".tiff"),
    "tiff_raw_little_endian": (lambda f, b: f.tiff(203, 271), ".tiff"),
    "tiff_raw_big_endian": (lambda f, b: f.tiff(203, 271, big_endian=True), ".tiff"),
    "tiff_gray_16bit": (lambda f, b: cv(cv2.cvtColor(b, cv2.COLOR_BGR2GRAY).astype(np.uint16) * 257, ".tiff"), ".tiff"),
    "tiff_rgb_16bit": (lambda f, b: cv(b.astype(np.uint16) * 257 + 99, ".tiff"), ".tiff"),
    "tiff_rgba_16bit": (lambda f, b: cv(cv2.cvtColor(b, cv2.COLOR_BGR2BGRA).astype(np.uint16) * 257 + 99, ".tiff"),
                        ".tiff"),
    "tiff_rgba": (lambda f, b: cv(cv2.cvtColor(b, cv2.COLOR_BGR2BGRA), ".tiff"), ".tiff"),
    "tiff_palette": (lambda f, b: pil(rgb(b).convert("P"), "TIFF"), ".tiff"),
    "tiff_cmyk": (lambda f, b: pil(rgb(b).convert("CMYK"), "TIFF"), ".tiff"),
    "tiff_jpeg_compressed": (lambda f, b: pil(rgb(b), "TIFF", compression="jpeg"), ".tiff"),
    "tiff_deflate": (lambda f, b: pil(rgb(b), "TIFF", compression="tiff_adobe_deflate"), ".tiff"),
    "tiff_group4": (lambda f, b: pil(rgb(b).convert("1"), "TIFF", compression="group4"), ".tiff"),
    "tiff_group4_forged": (lambda f, b: f.tiff_g4_white(203, 271), ".tiff"),
    "tiff_multipage": (lambda f, b: pil(rgb(b), "TIFF", save_all=True, append_images=[rgb(b[:50, :60])]), ".tiff"),
    "bigtiff": (lambda f, b: pil(rgb(b), "TIFF", big_tiff=True), ".tiff"),
    "bigtiff_big_endian": (lambda f, b: f.tiff(203, 271, bigtiff=True, big_endian=True), ".tiff"),
    "webp_lossy_vp8": (lambda f, b: cv(b, ".webp", cv2.IMWRITE_WEBP_QUALITY, 80), ".webp"),
    "webp_lossless_vp8l": (lambda f, b: cv(b, ".webp", cv2.IMWRITE_WEBP_QUALITY, 101), ".webp"),
    "webp_alpha_vp8x": (lambda f, b: pil(rgb(b).convert("RGBA"), "WEBP"), ".webp"),
    "webp_animated_vp8x": (lambda f, b: pil(rgb(b), "WEBP", save_all=True, append_images=[rgb(b[::-1])]), ".webp"),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_header_size_equals_what_opencv_and_pillow_decode(name, forge, bus):
    data = VARIANTS[name][0](forge, bus)
    header = read_header(data)
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    assert decoded is not None, name
    assert (header.height, header.width) == decoded.shape[:2] == (271, 203)
    if name != "bigtiff_big_endian":  # Pillow reads BigTIFF's version byte at the little-endian place only
        assert Image.open(io.BytesIO(data)).size == (header.width, header.height)
    assert check_image(data) == header


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_decode_equals_ultralytics_imread(name, forge, bus, tmp_path):
    from ultralytics.utils.patches import imread

    build, suffix = VARIANTS[name]
    data = build(forge, bus)
    path = tmp_path / f"image{suffix}"
    path.write_bytes(data)
    ours = decode_image(data)
    assert ours.dtype == np.uint8 and ours.ndim == 3 and ours.shape[2] == 3
    np.testing.assert_array_equal(ours, imread(str(path)))


def _with_marker(jpeg: bytes, marker: int) -> bytes:
    """The JPEG with its SOF0 marker changed to another SOFn (a header only Pillow can read then)."""
    from_sof = jpeg.index(b"\xff\xc0")
    return jpeg[: from_sof + 1] + bytes([marker]) + jpeg[from_sof + 2 :]


@pytest.mark.parametrize("marker", [0xC1, 0xC2, 0xC3, 0xC5, 0xC9, 0xCA, 0xCB, 0xCD, 0xCF])
def test_every_jpeg_sof_marker_is_a_frame_header(marker, forge, bus):
    data = _with_marker(forge.jpeg_with_size(cv(bus, ".jpg"), 4000, 3000), marker)
    header = read_header(data)
    assert Image.open(io.BytesIO(data)).size == (header.width, header.height) == (4000, 3000)


# --- bombs: refused before any pixel is decoded ----------------------------------------------
BOMBS = {
    # the cases
    "bmp_rle8_30000": lambda f, jpeg: f.bmp_rle8(30_000, 30_000),
    "bmp_40000_in_154_bytes": lambda f, jpeg: f.bmp(40_000, 40_000, header_size=124, rows=0),
    "tiff_group4_30000": lambda f, jpeg: f.tiff_g4_white(30_000, 30_000),
    "tiff_header_50000": lambda f, jpeg: f.tiff(50_000, 50_000, strip=b"\x00" * 64),
    "jpeg_fill_byte_50000": lambda f, jpeg: f.jpeg_with_size(jpeg, 50_000, 50_000, fill=1),
    "jpeg_fill_bytes_30000": lambda f, jpeg: f.jpeg_with_size(jpeg, 30_000, 30_000, fill=9),
    "webp_vp8l_16383": lambda f, jpeg: f.riff_webp(f.vp8l(16_383, 16_383)),
    "png_rgb_30000": lambda f, jpeg: f.png(30_000, 30_000, rows=2),
    # more of each class
    "jpeg_progressive_65535": lambda f, jpeg: _with_marker(f.jpeg_with_size(jpeg, 65_535, 65_535), 0xC2),
    "jpeg_arithmetic_40000": lambda f, jpeg: _with_marker(f.jpeg_with_size(jpeg, 40_000, 40_000), 0xC9),
    "jpeg_lossless_40000": lambda f, jpeg: _with_marker(f.jpeg_with_size(jpeg, 40_000, 40_000), 0xC3),
    "png_1bit_100000x1000": lambda f, jpeg: f.png(100_000, 1_000, bits=1, color=0, rows=1),
    "png_palette_2e31": lambda f, jpeg: f.png(2**31 - 1, 1, bits=1, color=3, rows=0),
    "bmp_core_header_65535": lambda f, jpeg: f.bmp(65_535, 65_535, header_size=12, rows=0),
    "bmp_top_down_minus_40000": lambda f, jpeg: f.bmp(40_000, -40_000, rows=0),
    "bmp_height_int_min": lambda f, jpeg: f.bmp(8, -(2**31), rows=0),
    "bmp_v5_rle4_1e5": lambda f, jpeg: f.bmp(100_000, 100_000, header_size=124, bpp=4, rows=0),
    "tiff_big_endian_50000": lambda f, jpeg: f.tiff(50_000, 50_000, big_endian=True, strip=b"\x00" * 64),
    "bigtiff_1e6": lambda f, jpeg: f.tiff(10**6, 10**6, bigtiff=True, strip=b"\x00" * 64),
    "tiff_multipage_huge_first": lambda f, jpeg: f.tiff(30_000, 30_000, pages=3, strip=b"\x00" * 64),
    "tiff_tile_buffer_1gb": lambda f, jpeg: f.tiff(100, 100, tile=(16_384, 16_000), strip=b"\x00" * 64),
    "tiff_strip_16bit_rgba_50mp": lambda f, jpeg: f.tiff(7_000, 7_000, bits=16, spp=4, strip=b"\x00" * 64),
    "webp_vp8_16383": lambda f, jpeg: f.riff_webp(f.vp8(16_383, 16_383)),
    "webp_vp8x_canvas_2e24": lambda f, jpeg: f.riff_webp(f.vp8x(2**24, 2**24), f.vp8l(16, 16)),
    "webp_vp8x_animated_8000": lambda f, jpeg: f.riff_webp(f.vp8x(8_000, 8_000, flags=0x02)),
}


@pytest.fixture
def no_decode(monkeypatch):
    """Fails the test if OpenCV is ever asked to decode."""

    def refuse(*args, **kwargs):
        raise AssertionError("cv2.imdecode called: the image was not refused from its header")

    monkeypatch.setattr(cv2, "imdecode", refuse)


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_bomb_refused_from_its_header(name, forge, assets_dir, no_decode):
    data = BOMBS[name](forge, (assets_dir / "bus.jpg").read_bytes())
    assert len(data) < 200_000
    with pytest.raises(ImageTooLarge):
        decode_image(data)


def test_a_bomb_under_a_lower_limit(forge, no_decode):
    """The issue's 1-bit PNG of 7,071²: 6 KB, 50 MP. Within the default limit; refused under a lower one."""
    data = forge.png(7_071, 7_071, bits=1, color=0)
    assert len(data) < 10_000 and check_image(data).pixels == 7_071**2
    with pytest.raises(ImageTooLarge, match="50,000,000|49,999,041"):
        check_image(data, max_pixels=10_000_000)


def test_the_default_budgets_admit_real_images_at_the_pixel_limit(forge):
    """The memory budget refuses pathological layouts, not big photos: a 50 MP 8-bit image of
    every format, and a 50 MP 16-bit RGB TIFF in strips, fit."""
    side = 7_071
    for data in (forge.png(side, side), forge.png(side, side, bits=16, color=6, rows=1), forge.bmp(side, side, rows=0),
                 forge.tiff(side, side, rows_per_strip=8, strip=b"\x00"), forge.riff_webp(forge.vp8x(side, side)),
                 forge.tiff(side, side, bits=16, rows_per_strip=8, strip=b"\x00")):
        header = check_image(data)
        assert decode_bytes(header) <= MAX_DECODE_BYTES


def test_opencv_pixel_cap_becomes_image_too_large(forge, assets_dir):
    """With our limits lifted, OpenCV's own cap (2^30 pixels) raises cv2.error: it must come
    back as ImageTooLarge, not escape."""
    data = forge.jpeg_with_size((assets_dir / "bus.jpg").read_bytes(), 50_000, 50_000, fill=1)
    with pytest.raises(ImageTooLarge, match="OpenCV"):
        decode_image(data, max_pixels=10**10, max_decode_bytes=10**13)


def test_other_opencv_errors_become_invalid_image(monkeypatch, bus):
    def fail(*args, **kwargs):
        raise cv2.error("OpenCV(5.0.0) /src/grfmt_x.cpp:12: error: (-2:Unspecified error) bad stream in function 'f'")

    monkeypatch.setattr(cv2, "imdecode", fail)
    with pytest.raises(InvalidImage, match=r"cannot decode this PNG image \(bad stream\)"):
        decode_image(cv(bus, ".png"))


# --- headers we cannot read, formats we refuse ------------------------------------------------
def _tiff_entries(*entries: tuple[int, int, int]) -> bytes:
    """A little-endian TIFF whose only directory holds these (tag, type, value) entries."""
    ifd = struct.pack("<H", len(entries))
    for tag, kind, value in entries:
        ifd += struct.pack("<HHI", tag, kind, 1) + struct.pack("<I" if kind == 4 else "<Hxx", value)
    return b"II*\x00" + struct.pack("<I", 8) + ifd + b"\x00" * 4


UNREADABLE = {
    "jpeg_garbage_then_sof_30000": lambda f, j: f.jpeg_with_size(j, 30_000, 30_000, garbage=b"\x00\x01junk"),
    "jpeg_app0_then_png": lambda f, j: j[:2] + b"\xff\xe0\x00\x04ab" + f.png(640, 480),
    "jpeg_soi_then_png": lambda f, j: b"\xff\xd8\xff" + f.png(640, 480),
    "jpeg_soi_then_png_at_its_idat": lambda f, j: b"\xff\xd8\xff" + f.png(640, 480)[8:],
    "jpeg_unknown_marker_before_frame": lambda f, j: j[:2] + b"\xff\x89\x00\x04ab" + j[2:],
    "png_1x1_inflating_to_64mb": lambda f, j: f.png_inflating_to(1, 1, 64 << 20),
    "png_640x480_inflating_past_its_rows": lambda f, j: f.png_inflating_to(640, 480, 640 * 3 * 480 + 480 + 1),
    "jpeg_scan_before_frame": lambda f, j: j[:2] + b"\xff\xda\x00\x02" + j[f.jpeg_sof(j):],
    "jpeg_second_soi": lambda f, j: j[:2] + b"\xff\xd8" + j[2:],
    "jpeg_segment_length_1": lambda f, j: j[:2] + b"\xff\xe1\x00\x01" + j[2:],
    "jpeg_truncated_in_app": lambda f, j: j[:30],
    "jpeg_height_zero": lambda f, j: f.jpeg_with_size(j, 640, 0),
    "jpeg_no_frame": lambda f, j: b"\xff\xd8\xff\xd9",
    "png_ihdr_wrong_length": lambda f, j: f.png(8, 8).replace(b"\x00\x00\x00\x0dIHDR", b"\x00\x00\x00\x0cIHDR"),
    "png_bit_depth_3": lambda f, j: f.png(8, 8)[:24] + b"\x03" + f.png(8, 8)[25:],
    "png_width_2e31": lambda f, j: f.png(2**31, 1, rows=0),
    "png_no_idat": lambda f, j: b"\x89PNG\r\n\x1a\n" + f.png_chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0)),
    "png_signature_only": lambda f, j: b"\x89PNG\r\n\x1a\n",
    "apng_frame_outside_canvas": lambda f, j: f.png(20, 10, before_idat=f.apng_chunks(20_000, 10_000)),
    "bmp_header_size_20": lambda f, j: f.bmp(8, 8)[:14] + struct.pack("<I", 20) + f.bmp(8, 8)[18:],
    "bmp_width_zero": lambda f, j: f.bmp(0, 8),
    "bmp_width_negative": lambda f, j: f.bmp(-8, 8, rows=0),
    "bmp_truncated": lambda f, j: b"BM" + b"\x00" * 10,
    "tiff_no_width": lambda f, j: _tiff_entries((257, 4, 10)),
    "tiff_duplicate_width": lambda f, j: _tiff_entries((256, 4, 30_000), (256, 4, 10), (257, 4, 10)),
    "tiff_signed_width": lambda f, j: _tiff_entries((256, 9, 10), (257, 4, 10)),
    "tiff_ifd_past_the_end": lambda f, j: b"II*\x00" + struct.pack("<I", 10**6),
    "bigtiff_truncated": lambda f, j: b"II+\x00\x08\x00\x00\x00",
    "webp_vp8_bad_start_code": lambda f, j: f.riff_webp(f.vp8(64, 64)).replace(b"\x9d\x01\x2a", b"\x00\x00\x00"),
    "webp_vp8l_bad_signature": lambda f, j: f.riff_webp(f.vp8l(64, 64)).replace(b"\x2f", b"\x2e", 1),
    "webp_unknown_chunk": lambda f, j: f.riff_webp(f.webp_chunk(b"VP9 ", b"\x00" * 16)),
    "webp_truncated": lambda f, j: b"RIFF\x10\x00\x00\x00WEBPVP8L",
}


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_unreadable_header_is_invalid_image_without_decoding(name, forge, assets_dir, no_decode):
    data = UNREADABLE[name](forge, (assets_dir / "bus.jpg").read_bytes())
    assert sniff_format(data) is not None
    with pytest.raises(InvalidImage):
        decode_image(data)


@pytest.mark.parametrize(
    "data",
    [b"GIF89a\x01\x00\x01\x00", b"%PDF-1.7", b"RIFF\x24\x00\x00\x00WAVEfmt ", b"\x00\x00\x00\x0cjP  \r\n\x87\n",
     b"P6\n1 1\n255\n\x00\x00\x00", b"#?RADIANCE\n", b"\x76\x2f\x31\x01", b"hello"],
    ids=["gif", "pdf", "wav", "jpeg2000", "ppm", "hdr", "exr", "text"],
)
def test_formats_opencv_knows_but_we_refuse(data, no_decode):
    with pytest.raises(UnsupportedMediaType):
        decode_image(data)


@pytest.mark.parametrize("bits,sample_format,message", [(32, 3, "floating-point TIFF"), (16, 3, "floating-point TIFF"),
                                                        (32, 1, "32-bit TIFF"), (64, 2, "64-bit TIFF")])
def test_tiff_samples_we_cannot_scale_are_refused_with_a_clear_message(bits, sample_format, message, forge, no_decode):
    with pytest.raises(UnsupportedMediaType, match=message):
        decode_image(forge.tiff(64, 48, bits=bits, sample_format=sample_format))


def _progressive(bus: np.ndarray, size: int = 64) -> bytes:
    return pil(rgb(cv2.resize(bus, (size, size))), "JPEG", progressive=True, quality=90)


def test_a_jpeg_with_a_thousand_scans_is_refused_without_decoding(forge, bus, no_decode):
    data = forge.jpeg_with_scans(_progressive(bus), 1_000)
    assert read_header(data).jpeg.scans == 1_000
    with pytest.raises(ImageTooLarge, match="1,000 scans"):
        decode_image(data)


def test_ordinary_progressive_jpegs_and_pngs_pass_the_work_checks(forge, bus):
    progressive = _progressive(bus, 640)
    facts = read_header(progressive).jpeg
    assert facts.progressive and 1 < facts.scans <= 12
    assert decode_image(progressive).shape == (640, 640, 3)
    assert decode_image(cv(bus, ".png")).shape == bus.shape
    adam7 = _adam7_png(forge, 37, 23)
    assert decode_image(adam7).shape == (23, 37, 3)


def _adam7_png(forge, width: int, height: int) -> bytes:
    """An interlaced RGB PNG (Adam7 passes of filter-0 scanlines): its exact inflated size."""
    from app.imaging.headers import _png_raw_bytes

    raw = _png_raw_bytes(width, height, 24, interlaced=True)
    ihdr = forge.png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 1))
    idat = forge.png_chunk(b"IDAT", zlib.compress(b"\x00" * raw))
    return b"\x89PNG\r\n\x1a\n" + ihdr + idat + forge.png_chunk(b"IEND", b"")


def test_the_jpeg_facts_a_gpu_decoder_needs_come_from_the_one_parser(bus):
    baseline = cv(bus, ".jpg")
    facts = read_header(baseline).jpeg
    assert (facts.width, facts.height, facts.components, facts.precision) == (bus.shape[1], bus.shape[0], 3, 8)
    assert facts.gpu_decodable and not facts.progressive and facts.scans == 1
    assert facts.sampling[0] == (2, 2)  # OpenCV's default 4:2:0
