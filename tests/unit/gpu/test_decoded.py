"""``app.gpu.decoded.route``: what a GPU decoder is handed, and the CPU path's own verdict on
everything else, message for message (issue #25: the same error on every path)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from app.errors import YolopipeError
from app.gpu.decoded import cpu_decode, route
from app.imaging.decode import decode_image


def cpu_verdict(data: bytes):
    try:
        return decode_image(data)
    except YolopipeError as exc:
        return exc


@pytest.fixture(scope="module")
def datas(assets_dir) -> list[bytes]:
    good = (assets_dir / "bus.jpg").read_bytes()
    png = cv2.imencode(".png", np.full((20, 30, 3), 99, np.uint8))[1].tobytes()
    progressive = cv2.imencode(".jpg", cv2.imread(str(assets_dir / "bus.jpg")), [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1]
    return [good, good[: len(good) // 3], b"\xff\xd8\xff\xe0 not really a jpeg", png, b"hello", b"", good[:-2],
            progressive.tobytes(), b"\xff\xd8"]


def test_headerless_bytes_get_the_cpu_paths_own_error_and_only_whole_jpegs_reach_the_gpu(datas):
    gpu, host = route(datas, [None] * len(datas))
    assert [i for i, _ in gpu] == [0, 7]  # the photo and its progressive copy: whole baseline/progressive JPEGs
    for i, got in host.items():
        want = cpu_verdict(datas[i])
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
        else:
            assert type(got) is type(want) and str(got) == str(want), (i, got, want)


def test_a_view_of_the_bytes_gets_the_verdict_of_the_bytes(datas):
    """A JPEG handed on as a uint8 view of its bytes where they lie (the inference worker's
    ``EncodedImage`` over an HTTP worker's ring) decodes on the CPU path as its bytes do, also
    where no header came with it (a GPU decoder that refused it falls back to ``cpu_decode``)."""
    for data in datas:
        want, got = cpu_verdict(data), cpu_decode(np.frombuffer(data, np.uint8))
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
        else:
            assert type(got) is type(want) and str(got) == str(want), (data[:16], got, want)
