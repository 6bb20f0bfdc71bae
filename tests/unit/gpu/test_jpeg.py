"""JPEG headers (size, components, coding, subsampling, EXIF orientation) read without a GPU,
and the EXIF turn of the nvJPEG fallback, against OpenCV's own decode."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from app.benchmark.workloads import VARIANTS, encode_variant, with_exif_orientation
from app.gpu.jpeg import apply_orientation, read_jpeg_header


@pytest.fixture(scope="module")
def asymmetric() -> np.ndarray:
    """A small image whose every orientation looks different (gradients + a corner mark)."""
    yy, xx = np.mgrid[0:48, 0:80]
    img = np.stack([xx * 3, yy * 5, (xx + yy) * 2], axis=-1).astype(np.uint8)
    img[:10, :16] = (0, 0, 255)
    return img


SUBSAMPLING = {(1, 1): "4:4:4", (2, 1): "4:2:2", (2, 2): "4:2:0", (4, 1): "4:1:1", (1, 2): "4:4:0"}
EXPECTED = {  # variant → (components, progressive, subsampling, orientation, GPU decodable)
    "420": (3, False, "4:2:0", 1, True),
    "444": (3, False, "4:4:4", 1, True),
    "422": (3, False, "4:2:2", 1, True),
    "411": (3, False, "4:1:1", 1, True),
    "440": (3, False, "4:4:0", 1, True),
    "progressive-420": (3, True, "4:2:0", 1, True),
    "progressive-444": (3, True, "4:4:4", 1, True),
    "gray": (1, False, "gray", 1, True),
    "gray-progressive": (1, True, "gray", 1, True),
    "cmyk": (4, False, "4:4:4", 1, False),
    **{f"exif-{o}": (3, False, "4:2:0", o, True) for o in range(2, 9)},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_header_of_every_variant(asymmetric, variant):
    data = encode_variant(asymmetric, variant)
    header = read_jpeg_header(data)
    assert header is not None
    assert all(s == (1, 1) for s in header.sampling[1:])  # chroma at 1x1: the luma factor names it
    sub = "gray" if header.components == 1 else SUBSAMPLING[header.sampling[0]]
    got = (header.components, header.progressive, sub, header.orientation, header.gpu_decodable)
    assert got == EXPECTED[variant]
    assert (header.height, header.width) == asymmetric.shape[:2]
    assert header.precision == 8 and not header.arithmetic and not header.lossless


def test_not_a_jpeg_or_cut_short():
    assert read_jpeg_header(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40) is None
    assert read_jpeg_header(b"\xff\xd8\xff\xe0\x00\x10JFIF") is None
    assert read_jpeg_header(b"") is None
    assert read_jpeg_header(b"\xff\xd8\xff\xe1\x00") is None  # truncated header: no crash


@pytest.mark.parametrize("orientation", range(1, 9))
def test_apply_orientation_matches_opencv(asymmetric, orientation):
    """Our EXIF reading + turning of an un-oriented decode equals cv2.imdecode (which applies EXIF)."""
    torch = pytest.importorskip("torch")
    data = with_exif_orientation(encode_variant(asymmetric, "444", quality=98), orientation)
    assert read_jpeg_header(data).orientation == orientation
    raw = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    chw = torch.from_numpy(np.ascontiguousarray(raw[..., ::-1].transpose(2, 0, 1)))
    ours = apply_orientation(chw, orientation).permute(1, 2, 0).numpy()[..., ::-1]
    ref = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    np.testing.assert_array_equal(ours, ref, err_msg=f"orientation {orientation}")
