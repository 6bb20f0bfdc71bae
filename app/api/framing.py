"""What a request means is decided once, here, before any route runs (pure ASGI middleware,
so it holds under any server, not only ``app.api.protocol``'s):

- **One value per header the server acts on.** Two ``Content-Type``, ``Content-Encoding``,
  ``Inference-Header-Content-Length``, ``Content-Length``, ``Transfer-Encoding`` or ``Host``
  headers (equal or not) are malformed framing: ``400``. A proxy may have acted on the one the
  server would not.
- **A path names one resource.** Uvicorn hands the application the percent-decoded path, so
  ``/v2/models/yolopipe%2Finfer`` would be routed as ``/v2/models/yolopipe/infer``: an encoded
  slash would act as a separator that a proxy filtering by path never saw. A path holding an
  encoded slash or backslash (``%2F``, ``%5C``), or a ``.``/``..`` segment (plain or encoded),
  names nothing here: ``404``.
- **A connection that will close says so** (RFC 9112 §9.6): after an HTTP/1.0 request, or one
  that asked ``Connection: close``, the answer carries ``Connection: close`` (uvicorn 0.38
  closed without saying it).
- **HEAD is GET without the body.** Every GET endpoint answers HEAD with GET's status and
  headers (its ``Content-Length`` included) and no body; an endpoint that streams (SSE) is
  ended after its headers.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import JSONResponse

from app.api.errors import error_body, error_response, http_error_code
from app.errors import BadRequest

SINGLE_VALUED = (b"host", b"content-length", b"transfer-encoding", b"content-type", b"content-encoding",
                 b"inference-header-content-length")


class RequestFramingMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            response = refusal(scope)
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def refusal(scope: dict) -> JSONResponse | None:
    """The answer to a request that means nothing here, or None."""
    seen: set[bytes] = set()
    for name, _value in scope.get("headers", ()):
        name = name.lower()
        if name in SINGLE_VALUED:
            if name in seen:
                response = error_response(BadRequest(f"malformed HTTP request: more than one {name.decode()} header"))
                response.headers["connection"] = "close"  # its body's framing is in doubt: not read
                return response
            seen.add(name)
    raw = scope.get("raw_path") or scope["path"].encode()
    lowered = raw.lower()
    if b"%2f" in lowered or b"%5c" in lowered:
        return _not_found(f"no such path: an encoded '/' or '\\' is not a path separator here ({_shown(raw)})")
    if any(segment in (".", "..") for segment in scope["path"].split("/")):
        return _not_found(f"no such path: '.' and '..' segments name nothing here ({_shown(raw)})")
    return None


def _not_found(message: str) -> JSONResponse:
    return JSONResponse(error_body(http_error_code(404), message), status_code=404)


def _shown(raw: bytes) -> str:
    return raw[:100].decode("latin-1")


class HeadAsGetMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        answered = asyncio.Event()

        async def receive_until_answered() -> dict:
            # Once the headers are out, the app hears that the client is gone: an endpoint that
            # streams (and waits for the client to leave) stops at once.
            if answered.is_set():
                return {"type": "http.disconnect"}
            message = asyncio.ensure_future(receive())
            done = asyncio.ensure_future(answered.wait())
            await asyncio.wait((message, done), return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
            if message.done():
                return message.result()
            message.cancel()
            return {"type": "http.disconnect"}

        async def send_headers_only(message: dict) -> None:
            if answered.is_set():
                return
            await send(message)
            if message["type"] == "http.response.start":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                answered.set()

        # The server keeps its own scope (HEAD): it sends no body, whatever reaches it.
        await self.app({**scope, "method": "GET"}, receive_until_answered, send_headers_only)


class ConnectionCloseMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not closes_after(scope):
            await self.app(scope, receive, send)
            return

        async def send_saying_close(message: dict) -> None:
            if message["type"] == "http.response.start" and not _says_close(message.get("headers", ())):
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_saying_close)


def closes_after(scope: dict) -> bool:
    """Whether the server closes the connection after answering this request: HTTP/1.0 (uvicorn
    keeps no 1.0 connection alive, ``Connection: keep-alive`` or not) or ``Connection: close``."""
    return scope.get("http_version") == "1.0" or _says_close(scope.get("headers", ()))


def _says_close(headers: Any) -> bool:
    return any(name.lower() == b"connection" and b"close" in (t.strip().lower() for t in value.split(b","))
               for name, value in headers)
