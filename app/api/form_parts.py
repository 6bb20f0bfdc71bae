"""A multipart/form-data body already read whole, split in one pass with ``bytes.find``, when
it has the plain shape every client library sends; ``None`` for anything else, which
``app.api.uploads`` then reads with Starlette's parser (so every unusual body is answered
exactly as before: a preamble, transport padding, ``filename*``, a quoted ``\\``, an LF line
end, a part header over the limits, too many parts, a body cut short ...).

The plain shape: the body opens with the delimiter line ``--BOUNDARY``; each part is header
lines ``Name: value`` (token names; one ``Content-Disposition: form-data; name="..."`` with an
optional ``; filename="..."``, printable ASCII without ``"``, ``\\`` or ``;`` inside the quotes),
a blank line, then its bytes up to the next ``CRLF--BOUNDARY``, which a CRLF (another part) or
``--`` (the end) follows; after the closing delimiter, nothing or one CRLF. On that shape
python-multipart and Starlette give the same parts: ``tests/unit/api/test_form_parts.py``
compares the two.
"""

from __future__ import annotations

import re

_CONTENT_TYPE = re.compile(r'multipart/form-data; ?boundary=(?:"([0-9A-Za-z\'()+_,./:=?-]{1,70})"|'
                           r"([0-9A-Za-z'+_.-]{1,70}))", re.IGNORECASE)
_DISPOSITION = re.compile(rb'form-data; name="([ !#$%&\'()*+,./0-9:<=>?@A-Z\[\]^_`a-z{|}~-]*)"'
                          rb'(?:; filename="([ !#$%&\'()*+,./0-9:<=>?@A-Z\[\]^_`a-z{|}~-]*)")?')
_HEADER_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
MAX_PART_HEADERS = 8  # header lines per part, and their bytes (python-multipart's and ours are larger)
MAX_PART_HEADER_BYTES = 1024


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a plain ``multipart/form-data; boundary=...`` Content-Type (no other
    parameter), or None."""
    found = _CONTENT_TYPE.fullmatch(content_type)
    return None if found is None else (found.group(1) or found.group(2)).encode()


def split_form(body: bytes, boundary: bytes, field: str, max_parts: int) -> list[tuple[str, bytes]] | None:
    """The parts named ``field`` as (file name, bytes) in order (``field[i]`` for one without a
    file name, as ``read_form_images`` names it), or None when the body is not of the plain
    shape or holds more than ``max_parts`` parts."""
    delimiter = b"\r\n--" + boundary
    opening = delimiter[2:] + b"\r\n"
    if not body.startswith(opening):
        return None
    wanted = field.encode()
    found: list[tuple[str, bytes]] = []
    pos = len(opening)
    for _ in range(max_parts):
        head_end = body.find(b"\r\n\r\n", pos, pos + MAX_PART_HEADER_BYTES)
        if head_end < 0:
            return None
        names = _part_names(body[pos:head_end])
        if names is None:
            return None
        data_start = head_end + 4
        end = body.find(delimiter, data_start)
        if end < 0:
            return None
        name, filename = names
        if name == wanted:
            found.append((filename.decode() if filename else f"{field}[{len(found)}]", body[data_start:end]))
        after = end + len(delimiter)
        follows = body[after : after + 2]
        if follows == b"\r\n":
            pos = after + 2
            continue
        rest = len(body) - after - 2
        if follows == b"--" and (rest == 0 or (rest == 2 and body.endswith(b"\r\n"))):
            return found
        return None
    return None  # more parts than max_parts


def _part_names(head: bytes) -> tuple[bytes, bytes | None] | None:
    """A part's field name and file name from its header lines, or None unless they are plain."""
    lines = head.split(b"\r\n")
    if len(lines) > MAX_PART_HEADERS or any(b"\r" in line or b"\n" in line for line in lines):
        return None
    names = None
    for line in lines:
        key, colon, value = line.partition(b":")
        if not colon or _HEADER_NAME.fullmatch(key) is None:
            return None
        if key.lower() != b"content-disposition":
            continue
        found = _DISPOSITION.fullmatch(value.lstrip(b" "))
        if found is None or names is not None:
            return None
        names = (found.group(1), found.group(2))
    return names
