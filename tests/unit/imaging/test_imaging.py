"""Decode and letterbox equal Ultralytics' own (``imread`` and ``LetterBox``)."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image
from ultralytics.data.augment import LetterBox

from app.errors import ImageTooLarge, InvalidImage, UnsupportedMediaType
from app.imaging.decode import decode_image
from app.imaging.headers import read_header, sniff_format
from app.imaging.letterbox import input_size, letterbox, letterbox_params, to_input


@pytest.mark.parametrize("shape", [(480, 640), (640, 480), (1080, 810), (160, 90), (33, 1000), (1, 1), (641, 639), (720, 1280)])
def test_letterbox_equals_ultralytics(shape):
    rng = np.random.default_rng(sum(shape))
    img = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    ours, lb = letterbox(img, 640)
    theirs = LetterBox((640, 640), auto=False, stride=32)(image=img)
    assert ours.shape == theirs.shape == (640, 640, 3)
    np.testing.assert_array_equal(ours, theirs)
    assert (lb.src_h, lb.src_w) == shape


# Odd and extreme sizes, sizes below imgsz (scaled up), and sizes whose rect placement rounds a
# side differently from what ``scale_boxes`` later recomputes (5 × 99, 12 × 239).
RECT_SHAPES = [(480, 640), (640, 480), (1080, 810), (720, 1280), (517, 333), (101, 1000), (160, 90), (33, 1000),
               (1, 1), (641, 639), (5, 99), (12, 239), (300, 300), (1000, 3), (479, 640), (427, 640)]


@pytest.mark.parametrize("shape", RECT_SHAPES)
def test_rect_letterbox_equals_ultralytics_predict_default(shape):
    """Rect: Ultralytics' ``LetterBox`` as ``model.predict(source)`` makes it on a ``.pt``
    (``auto=True``, the model's stride): the same pixels at the same smallest stride multiple."""
    rng = np.random.default_rng(sum(shape))
    img = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    ours, lb = letterbox(img, 640, 32)
    theirs = LetterBox(640, auto=True, stride=32)(image=img)
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)
    assert (lb.input_h, lb.input_w) == ours.shape[:2] == input_size(*shape, 640, 32)
    assert lb.input_h % 32 == 0 and lb.input_w % 32 == 0 and max(lb.input_h, lb.input_w) == 640


def test_square_placement_is_unchanged_by_the_rect_one():
    """``stride`` 0 is the square placement it always was: every size's fields as before."""
    for h, w in RECT_SHAPES:
        lb = letterbox_params(h, w, 640)
        r = min(640 / h, 640 / w)
        new_w, new_h = max(round(w * r), 1), max(round(h * r), 1)
        assert (lb.new_h, lb.new_w, lb.input_h, lb.input_w) == (new_h, new_w, 640, 640)
        assert (lb.pad_top, lb.pad_left) == (round((640 - new_h) / 2 - 0.1), round((640 - new_w) / 2 - 0.1))
        assert lb.undo == (lb.pad_left, lb.pad_top, new_w / w, new_h / h)


def test_letterbox_params_round_trip_is_centered():
    lb = letterbox_params(480, 640, 640)
    assert (lb.new_h, lb.new_w, lb.pad_top, lb.pad_left) == (480, 640, 80, 0)
    lb = letterbox_params(1080, 810, 640)
    assert (lb.new_h, lb.new_w) == (640, 480) and lb.pad_left == 80 and lb.pad_top == 0
    lb = letterbox_params(1080, 810, 640, 32)  # rect: nothing to pad, 480 is a multiple of 32
    assert (lb.input_h, lb.input_w, lb.pad_top, lb.pad_left) == (640, 480, 0, 0)
    lb = letterbox_params(427, 640, 640, 32)  # 427 rows padded to 448: 10 above, 11 below
    assert (lb.input_h, lb.input_w, lb.new_h, lb.pad_top) == (448, 640, 427, 10)


def test_to_input_is_rgb_chw_unit_range():
    img = np.zeros((4, 4, 3), np.uint8)
    img[..., 0] = 255  # blue in BGR
    batch = to_input([img, img])
    assert batch.shape == (2, 3, 4, 4) and batch.dtype == np.float32
    assert batch[:, 2].max() == 1.0 and batch[:, 0].max() == 0.0  # blue ends up as the last (B) channel


def _encode(img: np.ndarray, ext: str) -> bytes:
    ok, buf = cv2.imencode(ext, img)
    assert ok
    return buf.tobytes()


def test_decode_applies_exif_orientation(assets_dir):
    src = Image.open(assets_dir / "zidane.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    buf = io.BytesIO()
    src.save(buf, format="JPEG", exif=exif.tobytes())
    img = decode_image(buf.getvalue())
    assert img.shape[:2] == (src.width, src.height)  # portrait after rotation


def test_image_size_from_headers(assets_dir):
    data = (assets_dir / "bus.jpg").read_bytes()
    assert (read_header(data).height, read_header(data).width) == (1080, 810)
    png = _encode(np.zeros((37, 53, 3), np.uint8), ".png")
    assert (read_header(png).height, read_header(png).width) == (37, 53)
    assert sniff_format(b"%PDF-1.4") is None


@pytest.mark.parametrize(
    "data,error",
    [
        (b"", InvalidImage),
        (b"hello, world", UnsupportedMediaType),
        (b"%PDF-1.7\n...", UnsupportedMediaType),
        (b"\xff\xd8\xff\xe0" + b"\x00" * 20, InvalidImage),  # a JPEG that stops after its header
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 10, InvalidImage),
    ],
)
def test_decode_rejects_bad_bytes(data, error):
    with pytest.raises(error):
        decode_image(data)


def test_decode_truncated_real_jpeg(assets_dir):
    data = (assets_dir / "bus.jpg").read_bytes()
    with pytest.raises(InvalidImage):
        decode_image(data[:300])


def test_decompression_bomb_refused_from_header():
    # A real PNG header claiming 30,000 × 30,000 pixels: refused before any pixel is decoded.
    import struct
    import zlib

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 100)) + chunk(b"IEND", b"")
    with pytest.raises(ImageTooLarge):
        decode_image(png, max_pixels=50_000_000)
