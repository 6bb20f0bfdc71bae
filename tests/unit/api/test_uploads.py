"""Multipart parts read as bytes whatever their Content-Disposition says, and the per-request
pixel budget checked on headers before anything is decoded."""

from __future__ import annotations

import asyncio

import cv2
import httpx
import numpy as np
import pytest
from starlette.requests import Request

from app.api.uploads import check_request_images, read_form_images
from app.errors import BadRequest, ImageTooLarge, InvalidImage, InvalidParameter, UnsupportedMediaType
from app.imaging.headers import ImageHeader

BOUNDARY = "xYz"


def request_with(body: bytes, content_type: str, chunk: int = 1000) -> Request:
    """A Starlette request whose body arrives in ``chunk``-byte messages, as from a server."""
    chunks = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-type", content_type.encode())]}
    return Request(scope, receive)


def body_of(*parts: tuple[str, bytes], close: bool = True) -> bytes:
    """``parts``: (Content-Disposition parameters after form-data, bytes)."""
    out = b"".join(f"--{BOUNDARY}\r\nContent-Disposition: form-data; {d}\r\n\r\n".encode() + data + b"\r\n"
                   for d, data in parts)
    return out + (f"--{BOUNDARY}--\r\n".encode() if close else b"")


def read(body: bytes, field: str = "image", content_type: str = f"multipart/form-data; boundary={BOUNDARY}"):
    return asyncio.run(read_form_images(request_with(body, content_type), field, max_parts=10, max_body_bytes=1 << 22))


@pytest.fixture(scope="module")
def jpeg(assets_dir) -> bytes:
    return (assets_dir / "bus.jpg").read_bytes()


def test_a_part_with_only_filename_star_is_a_file(jpeg):
    """RFC 5987 names: python-multipart drops filename* and Starlette then decoded the JPEG as text."""
    [(name, data)] = read(body_of(("name=\"image\"; filename*=UTF-8''b%C3%BCs%20%22x%22.jpg", jpeg)))
    assert name == 'büs "x".jpg' and data == jpeg


def test_a_part_without_a_file_name_keeps_its_bytes(jpeg):
    """``curl -F 'image=<bus.jpg'`` sends the file as a plain field: its bytes must survive."""
    [(name, data)] = read(body_of(('name="image"', jpeg)))
    assert name == "image[0]" and data == jpeg


def test_plain_filenames_and_order_are_kept(jpeg):
    parts = [('name="images"; filename="a.jpg"', jpeg), ('name="other"', b"x"), ('name="images"; filename="b.png"', b"2")]
    assert read(body_of(*parts), field="images") == [("a.jpg", jpeg), ("b.png", b"2")]


def test_same_bytes_as_an_httpx_upload(jpeg):
    request = httpx.Request("POST", "http://x/", files=[("images", ("bus.jpg", jpeg, "image/jpeg")),
                                                        ("images", ("two.jpg", jpeg[:100], "image/jpeg"))])
    body = request.read()
    assert read(body, "images", request.headers["content-type"]) == [("bus.jpg", jpeg), ("two.jpg", jpeg[:100])]


@pytest.mark.parametrize(
    "body,content_type,error",
    [
        (body_of(('name="image"; filename="a.jpg"', b"abc"), close=False), None, BadRequest),  # cut short
        (b"no parts at all", None, BadRequest),
        (body_of(('name="image"', b"abc")), "multipart/form-data", BadRequest),  # no boundary
        (body_of(('filename="a.jpg"', b"abc")), None, BadRequest),  # a part without a name
        (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"image\"; x=\"{'a' * 5000}\"\r\n\r\nabc\r\n"
         f"--{BOUNDARY}--\r\n".encode(), None, BadRequest),  # a part header over python-multipart's 4 KB
        (body_of(*[(f'name="image"; filename="{i}"', b"x") for i in range(11)]), None, BadRequest),  # too many
        (body_of(('name="file"; filename="a.jpg"', b"abc")), None, InvalidParameter),  # no such field
        (body_of(('name="image"; fi"ename="a.jpg"', b"abc")), None, BadRequest),  # was a 500 (an assertion)
    ],
    ids=["cut_short", "garbage", "no_boundary", "no_name", "long_part_header", "too_many_parts", "wrong_field",
         "unbalanced_quote"],
)
def test_malformed_bodies(body, content_type, error):
    with pytest.raises(error):
        read(body, content_type=content_type or f"multipart/form-data; boundary={BOUNDARY}")


# --- the per-request pixel budget --------------------------------------------------------------
def test_budget_admits_in_order_and_fails_only_the_slots_past_it(forge):
    """The issue's batch: 1-bit PNGs of 7,071² (6 KB each, 50 MP each). Four fit 200 MP."""
    bomb = forge.png(7_071, 7_071, bits=1, color=0)
    checked = check_request_images([bomb] * 24, max_request_pixels=200_000_000)
    assert [type(c) for c in checked] == [ImageHeader] * 4 + [ImageTooLarge] * 20
    assert "budget of 200,000,000 pixels" in str(checked[4])


def test_budget_skips_bad_images_and_counts_only_admitted_pixels(forge, jpeg):
    small = cv2.imencode(".png", np.zeros((10, 10, 3), np.uint8))[1].tobytes()
    datas = [b"", b"%PDF", forge.bmp_rle8(30_000, 30_000), forge.png(100, 100), jpeg, small]
    checked = check_request_images(datas, max_pixels=1_000_000, max_request_pixels=10_000 + 810 * 1080)
    assert [type(c) for c in checked] == [InvalidImage, UnsupportedMediaType, ImageTooLarge, ImageHeader,
                                          ImageHeader, ImageTooLarge]
    assert (checked[4].height, checked[4].width) == (1080, 810)
