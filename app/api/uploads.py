"""Images out of a multipart body, and a per-request budget on what they will take to decode.

Starlette reads a part as a file only when its Content-Disposition has ``filename=``; a part
with only RFC 5987's ``filename*=`` (python-multipart drops it: RFC 7578 forbids it in forms)
or with no file name at all (``curl -F 'image=<bus.jpg'``) became text, decoded with a
charset, and its JPEG bytes no longer decoded (415). ``read_form_images`` reads every part as
bytes, names it from ``filename*`` when that is all it has, and keeps the parts in memory
(the body limit already bounds them), so no part is spooled to disk through a thread.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from python_multipart.multipart import parse_options_header
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from app.config import MAX_DECODE_BYTES, MAX_PIXELS, MAX_REQUEST_PIXELS
from app.errors import BadRequest, ImageTooLarge, InvalidParameter, YolopipeError
from app.imaging.check import check_image
from app.imaging.headers import ImageHeader

# Decoded pixels one request may hold: ~600 MB of BGR if all are alive at once, ~2 s of decoding.
_EXTENDED_FILENAME = re.compile(r"""(?:^|;)\s*filename\*\s*=\s*("?)([^";]*)\1""", re.IGNORECASE)


async def read_form_images(
    request: Request, field: str, *, max_parts: int, max_body_bytes: int
) -> list[tuple[str, bytes]]:
    """The parts named ``field`` of a multipart body, as (file name, bytes), in order.

    ``max_parts`` bounds the number of parts; ``max_body_bytes`` is the body limit that
    ``BodyLimitMiddleware`` enforces while the body streams in: parts up to it stay in memory.

    A part without a file name is named ``field[i]``. Malformed multipart → ``BadRequest``
    (400); no part named ``field`` → ``InvalidParameter`` (422). The body limit
    (``ImageTooLarge``) and a client hanging up (``ClientDisconnect``) propagate.
    """
    parser = _BytesPartsParser(request.headers, request.stream(), max_files=max_parts, max_fields=max_parts,
                               spool_max_size=max_body_bytes)
    try:
        form = await parser.parse()
    except (MultiPartException, KeyError) as exc:  # KeyError: no Content-Type with a boundary
        detail = getattr(exc, "message", None) or "missing boundary"
        raise BadRequest(f"malformed multipart body: {detail}") from None
    if not parser.closed:
        await form.close()
        raise BadRequest("malformed multipart body: it ends before its closing boundary")
    try:
        images = []
        for i, value in enumerate(form.getlist(field)):
            assert isinstance(value, UploadFile)  # every part is a file here
            images.append((value.filename or f"{field}[{i}]", await value.read()))
    finally:
        await form.close()
    if not images:
        raise InvalidParameter(f"the multipart body has no field {field!r}")
    return images


def check_request_images(
    datas: list[bytes],
    *,
    max_pixels: int = MAX_PIXELS,
    max_request_pixels: int = MAX_REQUEST_PIXELS,
    max_decode_bytes: int = MAX_DECODE_BYTES,
) -> list[ImageHeader | YolopipeError]:
    """Each image's header checked before anything is decoded, in request order: its header,
    or the error that fails it alone, in its place (not an image, unreadable, over the per-image
    limits, or past the per-request pixel budget once the images before it are counted)."""
    results: list[ImageHeader | YolopipeError] = []
    total = 0
    for data in datas:
        try:
            header = check_image(data, max_pixels=max_pixels, max_decode_bytes=max_decode_bytes)
        except YolopipeError as exc:
            results.append(exc)
            continue
        if total + header.pixels > max_request_pixels:
            results.append(ImageTooLarge(
                f"this image's {header.pixels:,} pixels would take the request past its budget of "
                f"{max_request_pixels:,} pixels ({total:,} already taken by the images before it)"
            ))
            continue
        total += header.pixels
        results.append(header)
    return results


class _BytesPartsParser(MultiPartParser):
    """Starlette's parser with every part read as an in-memory file, and a body that must end
    with its closing boundary (Starlette accepts one cut short and drops its last part)."""

    def __init__(self, *args: Any, spool_max_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spool_max_size = spool_max_size
        self.closed = False

    def on_end(self) -> None:  # the closing boundary was read
        self.closed = True

    def on_headers_finished(self) -> None:
        disposition = self._current_part.content_disposition
        if disposition is not None and b"filename" not in parse_options_header(disposition)[1]:
            name = _extended_filename(disposition.decode("latin-1")) or ""
            quoted = name.replace("\\", "\\\\").replace('"', '\\"')
            self._current_part.content_disposition = disposition + b'; filename="' + quoted.encode() + b'"'
        super().on_headers_finished()


def _extended_filename(disposition: str) -> str | None:
    """RFC 5987 ``filename*=charset'language'percent-encoded`` → the name, or None."""
    found = _EXTENDED_FILENAME.search(disposition)
    if found is None:
        return None
    charset, _, rest = found.group(2).partition("'")
    _, _, encoded = rest.partition("'")
    try:
        return unquote(encoded, encoding=charset or "utf-8", errors="replace")
    except LookupError:  # an unknown charset
        return unquote(encoded, encoding="latin-1")
