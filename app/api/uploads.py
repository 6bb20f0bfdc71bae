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
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote

from python_multipart.multipart import parse_options_header
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from app.api.form_parts import boundary_of, split_form
from app.config import MAX_DECODE_BYTES, MAX_PIXELS, MAX_REQUEST_PIXELS
from app.errors import BadRequest, ImageTooLarge, InvalidParameter, UnsupportedMediaType, YolopipeError
from app.imaging.check import check_image
from app.imaging.headers import ImageHeader

# Decoded pixels one request may hold: ~600 MB of BGR if all are alive at once, ~2 s of decoding.
MAX_PART_HEADER_BYTES = 4096  # all of one part's header lines together
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
    return await _parse_form(request.headers, request.stream(), field, max_parts=max_parts,
                             max_body_bytes=max_body_bytes)


async def form_images(body: bytes, headers: Headers, field: str, *, max_parts: int,
                      max_body_bytes: int) -> list[tuple[str, bytes]]:
    """``read_form_images`` of a body already read whole: split in one pass when it has the plain
    shape (``app.api.form_parts``), else read by the same parser as a streamed one."""
    boundary = boundary_of(headers.get("content-type", ""))
    if boundary is not None and "content-encoding" not in headers:
        images = split_form(body, boundary, field, max_parts)
        if images:
            return images

    async def whole() -> AsyncIterator[bytes]:
        yield body

    return await _parse_form(headers, whole(), field, max_parts=max_parts, max_body_bytes=max_body_bytes)


async def _parse_form(headers: Headers, stream: AsyncIterator[bytes], field: str, *, max_parts: int,
                      max_body_bytes: int) -> list[tuple[str, bytes]]:
    coding = headers.get("content-encoding", "identity").strip().lower()
    if coding != "identity":
        raise UnsupportedMediaType(f"a {coding[:40]!r}-encoded multipart body is not read here: send it as is")
    boundary = parse_options_header(headers.get("content-type", ""))[1].get(b"boundary")
    if not boundary:
        raise BadRequest("malformed multipart body: its Content-Type names no boundary")
    if len(boundary) > 70:  # RFC 2046 §5.1.1
        raise BadRequest("malformed multipart body: its boundary is over 70 characters")
    parser = _BytesPartsParser(headers, _without_preamble(stream, boundary), max_files=max_parts,
                               max_fields=max_parts, spool_max_size=max_body_bytes)
    try:
        form = await parser.parse()
    except (MultiPartException, ValueError) as exc:
        # python-multipart's errors are ValueErrors; Starlette before 0.51 let them escape (a 500).
        detail = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        raise BadRequest(f"malformed multipart body: {detail[:200]}") from None
    if not parser.closed:
        await form.close()
        raise BadRequest("malformed multipart body: it ends before its closing boundary")
    try:
        images = []
        for i, value in enumerate(form.getlist(field)):
            if not isinstance(value, UploadFile):  # an unbalanced quote hid the file name added to it
                raise BadRequest("malformed multipart body: a part's Content-Disposition cannot be read")
            images.append((value.filename or f"{field}[{i}]", await value.read()))
    finally:
        await form.close()
    if not images:
        raise InvalidParameter(f"the multipart body has no field {field!r}")
    return images


async def _without_preamble(stream: AsyncIterator[bytes], boundary: bytes) -> AsyncIterator[bytes]:
    """``stream`` from its first delimiter on: RFC 2046 allows a preamble before it, which
    python-multipart refuses. What is held meanwhile is bounded by the body limit."""
    pattern = b"\r\n--" + boundary
    held, found = b"\r\n", False  # as if a line ended before the body: it may open with the delimiter
    async for chunk in stream:
        if found:
            yield chunk
            continue
        held += chunk
        at = held.find(pattern)
        if at < 0:
            held = held[-(len(pattern) - 1):]  # a delimiter may straddle the next chunk
            continue
        found = True
        yield held[at + 2:]
    if not found:
        raise BadRequest("malformed multipart body: no line in it is the boundary its Content-Type names")


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
        self._part_header_bytes = 0

    def on_end(self) -> None:  # the closing boundary was read
        self.closed = True

    # A part's headers are bounded as newer python-multiparts bound them (older ones do not).
    def on_part_begin(self) -> None:
        self._part_header_bytes = 0
        super().on_part_begin()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header_bytes(end - start)
        super().on_header_field(data, start, end)

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header_bytes(end - start)
        super().on_header_value(data, start, end)

    def _count_header_bytes(self, n: int) -> None:
        self._part_header_bytes += n
        if self._part_header_bytes > MAX_PART_HEADER_BYTES:
            raise MultiPartException(f"a part's headers are over {MAX_PART_HEADER_BYTES:,} bytes")

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
