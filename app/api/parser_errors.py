"""What ``app.api.protocol.JsonHttpToolsProtocol`` answers when httptools stops parsing a request:
the error a parser callback refused the request with (``Refuse``), or one made from llhttp's
reason (``parser_error``)."""

from __future__ import annotations

import logging
import re

import httptools

from app.errors import BadRequest, HttpVersionNotSupported, MethodNotImplemented, YolopipeError

log = logging.getLogger("yolopipe.api.protocol")

_TOKEN_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ ")


class Refuse(Exception):
    """Raised inside a parser callback to stop parsing and answer ``error``."""

    def __init__(self, error: YolopipeError) -> None:
        super().__init__(error.message)
        self.error = error


def parser_error(exc: httptools.HttpParserError, data: bytes | None) -> YolopipeError:
    """The answer to a parser error: ours when a callback refused, else from llhttp's reason.
    ``data``: the refused request's first bytes, or None where they are not known."""
    if isinstance(exc.__context__, Refuse):
        return exc.__context__.error
    if isinstance(exc.__context__, httptools.HttpParserInvalidURLError):  # raised by uvicorn parsing the URL
        return BadRequest("malformed HTTP request: invalid request target")
    if exc.__context__ is not None:
        log.warning("HTTP parser callback failed: %r", exc.__context__)
    reason = str(exc) or "malformed request"
    if isinstance(exc, httptools.HttpParserInvalidMethodError) and data is not None and _TOKEN_METHOD.match(data):
        return MethodNotImplemented(f"request method {data.split(b' ', 1)[0][:32].decode('latin-1')!r} is not implemented")
    if reason in ("Invalid HTTP version", "Pause on PRI/Upgrade"):
        return HttpVersionNotSupported(f"only HTTP/1.0 and HTTP/1.1 are served here ({reason})")
    return BadRequest(f"malformed HTTP request: {reason}")
