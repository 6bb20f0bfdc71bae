"""The body size limit, enforced while the body streams in (never after buffering it)."""

from __future__ import annotations

from typing import Any

from app.api.errors import error_response
from app.errors import ImageTooLarge


class BodyLimitMiddleware:
    """Pure ASGI middleware.

    A declared ``Content-Length`` over the limit is answered with 413 before any byte is
    read. Otherwise (chunked uploads, lying headers) ``receive`` counts bytes and raises
    ``ImageTooLarge`` once past the limit; the handler reading the body lets it propagate to
    the error mapping, so at most ``limit`` plus one chunk is ever held.
    """

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            exc = ImageTooLarge(f"request body of {declared:,} bytes is over the limit of {self.limit:,}")
            response = error_response(exc)
            response.headers["connection"] = "close"  # the unread body makes the connection unusable
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise ImageTooLarge(f"request body is over the limit of {self.limit:,} bytes")
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
