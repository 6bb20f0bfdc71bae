"""The body size limits, enforced while the body streams in (never after buffering it), a
limit on the requests with a body one HTTP worker holds at once, and a client that hangs up
mid-body answered quietly (no 500, no traceback)."""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import ClientDisconnect

from app.api.errors import error_response
from app.api.protocol import ANSWERED_STATUS
from app.api.statuses import status_for
from app.errors import ClientDisconnected, ImageTooLarge, Overloaded

log = logging.getLogger("yolopipe.api")


class BodyHolds:
    """The requests with a body one HTTP worker holds, from their first byte to the end of their
    answer (``count``), and how many it may hold (``limit``; 0: no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def full(self) -> bool:
        return bool(self.limit) and self.count >= self.limit


class BodyLimitMiddleware:
    """Pure ASGI middleware.

    A declared ``Content-Length`` over the limit is answered with 413 before any byte is
    read. Otherwise (chunked uploads, lying headers) ``receive`` counts bytes and raises
    ``ImageTooLarge`` once past the limit; the handler reading the body lets it propagate to
    the error mapping, so at most ``limit`` plus one chunk is ever held. A response that
    starts before the body was read to its end says ``connection: close``: the rest of the
    body is not worth reading.

    A client that goes away while its body is read makes Starlette raise ``ClientDisconnect``.
    Nobody is left to answer, so nothing is logged above debug level; the response "sent" to
    the gone client carries 499 (or the status ``JsonHttpToolsProtocol`` already answered, e.g.
    408 or 400) so that /metrics counts it as what it was, not as a 500.

    At most ``holds.limit`` requests with a body (a Content-Length or chunked) are held at
    once, from their first byte to the end of their answer: one more is answered 503 before its
    body is read. So the bodies this process holds stay under ``holds.limit`` × the body
    limit, whatever the clients do (the hot path, ``app/api/hotpath``, takes its slots from the
    same ``holds``); requests without a body (probes, /metrics) are never refused.
    """

    def __init__(self, app: Any, max_body_bytes: int, limits: dict[str, int] | None = None,
                 holds: BodyHolds | None = None) -> None:
        """``limits``: a smaller limit for the paths under each prefix (the streams API's JSON);
        ``holds``: the requests with a body this process holds (shared with the hot path)."""
        self.app = app
        self.default = max_body_bytes
        self.limits = sorted((limits or {}).items(), key=lambda item: -len(item[0]))
        self.holds = holds or BodyHolds(0)

    def limit_for(self, path: str) -> int:
        for prefix, limit in self.limits:
            if path == prefix or path.startswith(prefix + "/"):
                return limit
        return self.default

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            exc = ImageTooLarge(f"request body of {declared:,} bytes is over the limit of {limit:,}")
            response = error_response(exc)
            response.headers["connection"] = "close"  # the unread body makes the connection unusable
            await response(scope, receive, send)
            return
        received = 0
        body_unread = bool(declared) or _header(scope, b"transfer-encoding") is not None
        if body_unread and self.holds.full():
            response = error_response(Overloaded(
                f"this server process holds {self.holds.count} requests already, its limit; retry shortly"))
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        holds = int(body_unread)
        self.holds.count += holds
        started = False
        over: ImageTooLarge | None = None

        async def limited_receive() -> dict:
            nonlocal received, body_unread, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_unread = body_unread and message.get("more_body", False)
                if received > limit:
                    over = ImageTooLarge(f"request body is over the limit of {limit:,} bytes")
                    raise over
            return message

        async def closing_send(message: dict) -> None:
            nonlocal started
            if over is not None:
                # Whatever the app made of the error (FastAPI turns one raised while it reads a
                # JSON body into its own 400), the answer is the 413.
                if message["type"] == "http.response.start" and not started:
                    started = True
                    response = error_response(over)
                    response.headers["connection"] = "close"
                    await response(scope, receive, send)
                return
            if message["type"] == "http.response.start":
                started = True
                if body_unread:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, limited_receive, closing_send)
        except ClientDisconnect:
            status = scope.get("extensions", {}).get(ANSWERED_STATUS) or status_for(ClientDisconnected("gone"))
            log.debug("%s %s: the client went away while sending its body (%d)", scope["method"], scope["path"], status)
            if not started:
                await send({"type": "http.response.start", "status": status, "headers": []})
                await send({"type": "http.response.body", "body": b""})
        finally:
            self.holds.count -= holds


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _content_length(scope: dict) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
