"""The one-pass multipart split (``app.api.form_parts``) gives exactly what Starlette's parser
gives (``app.api.uploads.read_form_images``, the parts or the error) on every body: it takes
the plain shape that client libraries send, and hands anything else to the parser."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import requests
from starlette.datastructures import Headers
from starlette.requests import Request

from app.api.form_parts import boundary_of, split_form
from app.api.uploads import form_images, read_form_images
from app.errors import YolopipeError

BOUNDARY = "b0und-7d1c"
MAX_PARTS = 6


def request_with(body: bytes, content_type: str, chunk: int) -> Request:
    chunks = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "query_string": b"",
                    "headers": [(b"content-type", content_type.encode())]}, receive)


def outcome(call) -> object:
    """The parts, or the error's type and message."""
    try:
        return asyncio.run(call())
    except YolopipeError as exc:
        return type(exc).__name__, str(exc)


def parsed(body: bytes, content_type: str, field: str, chunk: int = 1 << 30) -> object:
    """What Starlette's parser makes of ``body`` (in one piece, as the hot path hands it over: its
    error messages name offsets within a piece)."""
    return outcome(lambda: read_form_images(request_with(body, content_type, chunk), field, max_parts=MAX_PARTS,
                                            max_body_bytes=1 << 22))


def split_or_parsed(body: bytes, content_type: str, field: str) -> object:
    headers = Headers(raw=[(b"content-type", content_type.encode())])
    return outcome(lambda: form_images(body, headers, field, max_parts=MAX_PARTS, max_body_bytes=1 << 22))


def plain(parts: list[tuple[str, bytes]], boundary: str = BOUNDARY, extra: str = "", end: bytes = b"\r\n") -> bytes:
    """``parts``: (Content-Disposition parameters after ``form-data; ``, bytes)."""
    body = b"".join(f"--{boundary}\r\nContent-Disposition: form-data; {d}\r\n{extra}\r\n".encode() + data + b"\r\n"
                    for d, data in parts)
    return body + f"--{boundary}--".encode() + end


JPEG = bytes(range(256)) * 40 + b"\r\n-" + b"\r\n--b0und" + b"\r\n--b0und-7d1" + b"\xff\xd9"  # near-delimiters
PLAIN = {
    "one_file": plain([('name="image"; filename="bus.jpg"', JPEG)]),
    "no_file_name": plain([('name="image"', JPEG)]),
    "empty_file_name": plain([('name="image"; filename=""', JPEG)]),
    "empty_data": plain([('name="image"; filename="a.jpg"', b"")]),
    "part_content_type": plain([('name="image"; filename="a b(1).jpg"', JPEG)], extra="Content-Type: image/jpeg\r\n"),
    "several_and_others": plain([('name="images"; filename="1.jpg"', JPEG), ('name="other"', b"x"),
                                 ('name="images"', JPEG[:10]), ('name="images"; filename="3.png"', b"\r\n")]),
    "no_trailing_crlf": plain([('name="image"; filename="a.jpg"', JPEG)], end=b""),
    "no_such_field": plain([('name="file"; filename="a.jpg"', JPEG)]),
}
ODD = {
    "preamble": b"preamble\r\n" + PLAIN["one_file"],
    "epilogue": PLAIN["one_file"] + b"epilogue",
    "padding_after_delimiter": PLAIN["one_file"].replace(f"--{BOUNDARY}\r\n".encode(), f"--{BOUNDARY} \r\n".encode(), 1),
    "lf_line_ends": PLAIN["one_file"].replace(b"\r\n", b"\n"),
    "filename_star": plain([("name=\"image\"; filename*=UTF-8''b%C3%BCs.jpg", JPEG)]),
    "backslash_in_name": plain([('name="image"; filename="C:\\\\dir\\\\a.jpg"', JPEG)]),
    "utf8_file_name": plain([('name="image"; filename="büs.jpg"', JPEG)]),
    "unquoted_name": plain([("name=image; filename=a.jpg", JPEG)]),
    "upper_case_disposition": plain([('NAME="image"; filename="a.jpg"', JPEG)]),
    "two_dispositions": plain([('name="image"; filename="a.jpg"', JPEG)],
                              extra='Content-Disposition: form-data; name="other"\r\n'),
    "no_disposition": f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\n\r\n".encode() + JPEG + f"\r\n--{BOUNDARY}--\r\n".encode(),
    "no_name": plain([('filename="a.jpg"', JPEG)]),
    "header_without_colon": plain([('name="image"', JPEG)], extra="NoColon\r\n"),
    "too_many_parts": plain([(f'name="image"; filename="{i}"', b"x") for i in range(MAX_PARTS + 1)]),
    "long_part_header": plain([('name="image"; x="' + "a" * 5000 + '"', JPEG)]),
    "nul_in_type": plain([('name="image"', JPEG)]).replace(b"form-data", b"form\x00data"),
    "cut_short": plain([('name="image"; filename="a.jpg"', JPEG)])[:-12],
    "no_closing": plain([('name="image"; filename="a.jpg"', JPEG)])[: -len(BOUNDARY) - 6],
    "only_closing": f"--{BOUNDARY}--\r\n".encode(),
    "garbage": b"no parts at all",
    "empty": b"",
}


@pytest.mark.parametrize("name", list(PLAIN))
def test_a_plain_body_is_split_in_one_pass_into_what_the_parser_reads(name):
    body = PLAIN[name]
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    field = "images" if name == "several_and_others" else "image"
    fast = split_form(body, boundary_of(content_type), field, MAX_PARTS)
    assert fast is not None
    expected = parsed(body, content_type, field)
    if fast:
        assert fast == expected
    assert split_or_parsed(body, content_type, field) == expected


@pytest.mark.parametrize("name", list(ODD))
def test_any_other_body_goes_to_the_parser(name):
    body = ODD[name]
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    assert split_form(body, boundary_of(content_type), "image", MAX_PARTS) is None
    assert split_or_parsed(body, content_type, "image") == parsed(body, content_type, "image")


@pytest.mark.parametrize("content_type, boundary", [
    (f"multipart/form-data; boundary={BOUNDARY}", BOUNDARY.encode()),
    (f"multipart/form-data;boundary={BOUNDARY}", BOUNDARY.encode()),
    (f'Multipart/Form-Data; Boundary="{BOUNDARY}:=?"', (BOUNDARY + ":=?").encode()),
    (f"multipart/form-data; boundary={BOUNDARY}; charset=latin-1", None),
    (f"multipart/form-data; boundary={'b' * 71}", None),
    ("multipart/form-data", None),
    (f"multipart/mixed; boundary={BOUNDARY}", None),
])
def test_the_boundary_of_a_plain_content_type(content_type, boundary):
    assert boundary_of(content_type) == boundary


def test_client_libraries_send_the_plain_shape():
    """httpx, requests and a curl-style body, each split in one pass as the parser reads it."""
    files = [("images", ("bus.jpg", JPEG, "image/jpeg")), ("images", ("two.jpg", JPEG[:100], "image/jpeg"))]
    bodies = []
    for prepared in (httpx.Request("POST", "http://x/", files=files),
                     requests.Request("POST", "http://x/", files=files).prepare()):
        bodies.append((prepared.read() if hasattr(prepared, "read") else prepared.body, prepared.headers["content-type"]))
    curl = ("--------------------------d74496d66958873e\r\nContent-Disposition: form-data; name=\"images\"; "
            "filename=\"bus.jpg\"\r\nContent-Type: image/jpeg\r\n\r\n").encode() + JPEG \
        + b"\r\n--------------------------d74496d66958873e--\r\n"
    bodies.append((curl, "multipart/form-data; boundary=------------------------d74496d66958873e"))
    for body, content_type in bodies:
        fast = split_form(body, boundary_of(content_type), "images", MAX_PARTS)
        assert fast is not None and fast == parsed(body, content_type, "images")


def test_mutated_bodies_get_the_same_answer_either_way():
    """Bytes deleted, doubled or changed anywhere in plain bodies: the split and the parser agree
    on every one (the split taking it or handing it over)."""
    rng = random.Random(49)
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    specials = [b"\r", b"\n", b"\r\n", b"-", b"--", b'"', b";", b":", b" ", b"\\", b"\x00", BOUNDARY.encode()]
    for base in (PLAIN["one_file"], PLAIN["several_and_others"], PLAIN["part_content_type"]):
        base = base.replace(JPEG, JPEG[-40:])  # short data: most mutations land in the framing
        for _ in range(400):
            at = rng.randrange(len(base))
            kind = rng.randrange(3)
            if kind == 0:
                body = base[:at] + base[at + rng.randrange(1, 4):]
            elif kind == 1:
                body = base[:at] + rng.choice(specials) + base[at:]
            else:
                body = base[:at] + bytes([rng.randrange(256)]) + base[at + 1:]
            for field in ("image", "images"):
                assert split_or_parsed(body, content_type, field) == parsed(body, content_type, field), body
