"""A corpus of malformed and unusual inputs, generated here: each gets its documented status.

Documented statuses: 200 for every image we decode (CMYK, 16-bit, gray, alpha, EXIF-rotated,
palette, BMP/TIFF/WebP, 1 px); 400 empty/truncated/corrupt; 413 body or pixel limit; 415 not an
image or wrong content type; 422 bad parameters or a missing field. Never a 5xx, and the
server keeps answering after each.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from app.errors import ImageTooLarge
from app.imaging.decode import decode_image
from app.service.http_worker import create_service_app
from app.settings import Settings

BODY_LIMIT = 20 * 1024 * 1024  # the default; the corpus sends bodies just over it


@pytest.fixture(scope="module")
def client(artifacts_dir):
    app = create_service_app(Settings(backend="onnxruntime", artifacts_dir=artifacts_dir, max_body_bytes=BODY_LIMIT))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


# --- generators (bombs come from tests/forge.py) ----------------------------------------------
def pil_bytes(img: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def cv_bytes(img: np.ndarray, ext: str) -> bytes:
    ok, buf = cv2.imencode(ext, img)
    assert ok, ext
    return buf.tobytes()


def minimal_pdf() -> bytes:
    return (
        b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n2 0 obj<</Type/Pages/Kids[]/Count 0>>endobj\n"
        b"trailer<</Root 1 0 R>>\n%%EOF\n"
    )


@dataclass
class Case:
    status: int
    code: str | None  # the error code, None for a 200
    request: Callable[[dict[str, bytes]], dict[str, Any]]  # images → TestClient.post kwargs
    path: str = "/v1/detect"
    check: Callable[[dict, dict[str, bytes]], None] | None = field(default=None)


def raw(key: str, ctype: str = "image/jpeg", query: str = "") -> Callable[[dict[str, bytes]], dict[str, Any]]:
    return lambda im: {"content": im[key], "headers": {"content-type": ctype}, "params_query": query}


def multipart(key: str, field_name: str = "image", ctype: str = "image/jpeg", query: str = ""):
    return lambda im: {"files": {field_name: (f"{key}.bin", im[key], ctype)}, "params_query": query}


def batch(*keys: str, query: str = ""):
    return lambda im: {"files": [("images", (f"{k}.bin", im[k], "image/jpeg")) for k in keys], "params_query": query}


def rotated_check(body: dict, images: dict[str, bytes]) -> None:
    # EXIF orientation 6 (rotate 90° clockwise) turns the 810×1080 bus into 1080×810, as Ultralytics reads it.
    assert (body["width"], body["height"]) == (1080, 810)


CASES: dict[str, Case] = {
    # --- empty, truncated, corrupt → 400
    "zero_bytes_raw": Case(400, "invalid_image", raw("empty")),
    "zero_bytes_multipart": Case(400, "invalid_image", multipart("empty")),
    "truncated_jpeg_half": Case(400, "invalid_image", raw("jpeg_half")),
    "truncated_jpeg_header_only": Case(400, "invalid_image", raw("jpeg_400")),
    "truncated_png_half": Case(400, "invalid_image", raw("png_half", "image/png")),
    "truncated_png_signature_only": Case(400, "invalid_image", raw("png_sig", "image/png")),
    "png_bad_crc": Case(400, "invalid_image", raw("png_bad_crc", "image/png")),
    "jpeg_magic_then_noise": Case(400, "invalid_image", raw("jpeg_noise")),
    "malformed_multipart": Case(
        400, "bad_request",
        lambda im: {"content": b"--nope\r\nnot a part", "headers": {"content-type": "multipart/form-data; boundary=x"}},
    ),
    # --- not an image / wrong type → 415
    "plain_text": Case(415, "unsupported_media_type", raw("text")),
    "pdf": Case(415, "unsupported_media_type", raw("pdf", "image/png")),
    "pdf_multipart": Case(415, "unsupported_media_type", multipart("pdf", ctype="application/pdf")),
    "html": Case(415, "unsupported_media_type", raw("html")),
    "gif": Case(415, "unsupported_media_type", raw("gif", "image/gif")),
    "riff_not_webp": Case(415, "unsupported_media_type", raw("riff_wav", "image/webp")),
    "jpeg_as_text_plain": Case(415, "unsupported_media_type", raw("jpeg", "text/plain")),
    "jpeg_as_json": Case(415, "unsupported_media_type", raw("jpeg", "application/json")),
    "jpeg_no_content_type": Case(415, "unsupported_media_type", lambda im: {"content": im["jpeg"]}),
    "batch_raw_body": Case(415, "unsupported_media_type", raw("jpeg"), path="/v1/detect/batch"),
    # --- limits → 413
    "png_bomb_30000x30000": Case(413, "image_too_large", raw("png_bomb", "image/png")),
    "png_bomb_multipart": Case(413, "image_too_large", multipart("png_bomb", ctype="image/png")),
    "jpeg_header_30000x30000": Case(413, "image_too_large", raw("jpeg_bomb")),
    "huge_raw_body": Case(413, "image_too_large", raw("huge")),
    "huge_multipart": Case(413, "image_too_large", multipart("huge")),
    "huge_chunked_body": Case(
        413, "image_too_large",
        lambda im: {"content": iter([im["huge"][i : i + (1 << 20)] for i in range(0, len(im["huge"]), 1 << 20)]),
                    "headers": {"content-type": "image/jpeg"}},
    ),
    # --- parameters and fields → 422
    "conf_negative": Case(422, "invalid_parameter", raw("jpeg", query="conf=-0.1")),
    "conf_not_a_number": Case(422, "invalid_parameter", raw("jpeg", query="conf=abc")),
    "conf_nan": Case(422, "invalid_parameter", raw("jpeg", query="conf=nan")),
    "iou_over_one": Case(422, "invalid_parameter", raw("jpeg", query="iou=1.5")),
    "max_det_zero": Case(422, "invalid_parameter", raw("jpeg", query="max_det=0")),
    "max_det_huge": Case(422, "invalid_parameter", raw("jpeg", query="max_det=100000")),
    "classes_not_ints": Case(422, "invalid_parameter", raw("jpeg", query="classes=person")),
    "classes_unknown_id": Case(422, "invalid_parameter", raw("jpeg", query="classes=0,99")),
    "classes_negative": Case(422, "invalid_parameter", raw("jpeg", query="classes=-1")),
    "agnostic_not_bool": Case(422, "invalid_parameter", raw("jpeg", query="agnostic=maybe")),
    "multipart_wrong_field": Case(422, "invalid_parameter", multipart("jpeg", field_name="file")),
    "multipart_two_images": Case(
        422, "invalid_parameter",
        lambda im: {"files": [("image", ("a.jpg", im["jpeg"])), ("image", ("b.jpg", im["jpeg"]))]},
    ),
    "batch_no_images": Case(422, "invalid_parameter", multipart("jpeg", field_name="file"), path="/v1/detect/batch"),
    "batch_bad_param": Case(422, "invalid_parameter", batch("jpeg", query="iou=-1"), path="/v1/detect/batch"),
    # --- unusual but valid images → 200
    "cmyk_jpeg": Case(200, None, raw("cmyk")),
    "png_16bit": Case(200, None, raw("png16", "image/png")),
    "gray_png": Case(200, None, raw("gray_png", "image/png")),
    "gray_jpeg": Case(200, None, multipart("gray_jpeg")),
    "rgba_png": Case(200, None, raw("rgba", "image/png")),
    "palette_png": Case(200, None, raw("palette", "image/png")),
    "exif_rotated_jpeg": Case(200, None, raw("exif6"), check=rotated_check),
    "bmp": Case(200, None, raw("bmp", "image/bmp")),
    "tiff": Case(200, None, raw("tiff", "image/tiff")),
    "webp": Case(200, None, raw("webp", "image/webp")),
    "one_pixel_png": Case(200, None, raw("one_px", "image/png")),
    "png_sent_as_image_jpeg": Case(200, None, raw("gray_png", "image/jpeg")),
}


@pytest.fixture(scope="module")
def images(assets_dir, forge) -> dict[str, bytes]:
    jpeg = (assets_dir / "bus.jpg").read_bytes()
    bgr = cv2.imread(str(assets_dir / "bus.jpg"))
    small = cv2.resize(bgr, (320, 427))
    png = cv_bytes(small, ".png")
    pil = Image.open(io.BytesIO(jpeg))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90° CW to display
    bad_crc = bytearray(png)
    bad_crc[40] ^= 0xFF  # inside the IDAT data
    huge = b"\xff\xd8\xff" + b"\x00" * (BODY_LIMIT + 1024)
    return {
        "jpeg": jpeg,
        "empty": b"",
        "jpeg_half": jpeg[: len(jpeg) // 2],
        "jpeg_400": jpeg[:400],
        "png_half": png[: len(png) // 2],
        "png_sig": png[:8],
        "png_bad_crc": bytes(bad_crc),
        "jpeg_noise": b"\xff\xd8\xff\xe0" + np.random.default_rng(0).integers(0, 256, 5000, np.uint8).tobytes(),
        "text": b"hello, this is plain text and not an image",
        "pdf": minimal_pdf(),
        "html": b"<!doctype html><html><body><img src='bus.jpg'></body></html>",
        "gif": pil_bytes(pil.resize((64, 48)).convert("P"), "GIF"),
        "riff_wav": b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 32,
        "png_bomb": forge.png(30_000, 30_000, rows=4),
        "jpeg_bomb": forge.jpeg_with_size(jpeg, 30_000, 30_000),
        "huge": huge,
        "cmyk": pil_bytes(pil.convert("CMYK"), "JPEG", quality=90),
        "png16": cv_bytes(small.astype(np.uint16) * 257, ".png"),
        "gray_png": cv_bytes(cv2.cvtColor(small, cv2.COLOR_BGR2GRAY), ".png"),
        "gray_jpeg": cv_bytes(cv2.cvtColor(small, cv2.COLOR_BGR2GRAY), ".jpg"),
        "rgba": cv_bytes(cv2.cvtColor(small, cv2.COLOR_BGR2BGRA), ".png"),
        "palette": pil_bytes(pil.resize((320, 427)).convert("P"), "PNG"),
        "exif6": pil_bytes(pil, "JPEG", quality=95, exif=exif.tobytes()),
        "bmp": cv_bytes(small, ".bmp"),
        "tiff": cv_bytes(small, ".tiff"),
        "webp": cv_bytes(small, ".webp"),
        "one_px": cv_bytes(np.full((1, 1, 3), 200, np.uint8), ".png"),
    }


# The suffix Ultralytics' imread sees for each image a 200 case sends.
VALID_IMAGES = {"cmyk": ".jpg", "png16": ".png", "gray_png": ".png", "gray_jpeg": ".jpg", "rgba": ".png",
                "palette": ".png", "exif6": ".jpg", "bmp": ".bmp", "tiff": ".tiff", "webp": ".webp", "one_px": ".png"}


def test_the_valid_images_decode_as_ultralytics_reads_them(images, tmp_path):
    """A 200 below means the right thing only if the server sees the pixels Ultralytics sees."""
    from ultralytics.utils.patches import imread

    for key, suffix in VALID_IMAGES.items():
        path = tmp_path / f"{key}{suffix}"
        path.write_bytes(images[key])
        np.testing.assert_array_equal(decode_image(images[key]), imread(str(path)), err_msg=key)


def test_the_bombs_are_refused_before_decoding(images, monkeypatch):
    """The 413s below come from the header, not from a decode that happened to fail."""
    monkeypatch.setattr(cv2, "imdecode", lambda *a, **k: pytest.fail("decoded a bomb"))
    for key in ("png_bomb", "jpeg_bomb"):
        with pytest.raises(ImageTooLarge):
            decode_image(images[key])


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_input_gets_its_documented_status(client, images, name):
    case = CASES[name]
    kwargs = case.request(images)
    query = kwargs.pop("params_query", "")
    r = client.post(case.path + (f"?{query}" if query else ""), **kwargs)
    assert r.status_code == case.status, r.text
    body = r.json()
    if case.code is None:
        assert body["detections"] is not None and body["width"] > 0 and body["height"] > 0
        if case.check:
            case.check(body, images)
    else:
        assert set(body) == {"error"} and body["error"]["code"] == case.code, body
        assert "Traceback" not in r.text
    assert client.get("/healthz").status_code == 200


def test_server_still_detects_after_the_corpus(client, images):
    r = client.post("/v1/detect", content=images["jpeg"], headers={"content-type": "image/jpeg"})
    assert r.status_code == 200 and r.json()["detections"]
    metrics = client.get("/metrics").text
    server_errors = [line for line in metrics.splitlines()
                     if line.startswith("yolopipe_requests_total") and 'status="5' in line]
    assert server_errors == []
    assert "yolopipe_queue_depth 0.0" in metrics  # every admitted image was released
