"""The hot path's front: which requests it answers, and everything FastAPI's middlewares would
have done for them (``app/api/main.py`` lists those: framing, body limit, metrics, connection
close, the OIP error shape). ``app/api/hotpath/routes.py`` holds what each route does.

A request is taken only when nothing about it is unusual: ``POST`` to one of the hot paths
spelled plainly (no percent-escape, no dot segment, no root path), one value of every header
the server acts on, a ``Content-Length`` within the body limit (not chunked), a free slot in
``BodyHolds``, and what the route itself asks (``Route.prepare``). Everything else goes, before
a byte of its body is read, to the FastAPI app, which answers it as it always has.

What a taken request gets is what the middlewares gave it: its body read whole within the
limit; a client that hangs up while sending counted as 499 (or the status the protocol
answered); the answer, or its error in the route's shape (``/v1``'s ``{"error": {"code",
"message"}}``, ``/v2``'s ``{"error": message}``), with ``connection: close`` when the request
asked for it or was HTTP/1.0; every answer counted in /metrics by path and status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from app.api.errors import error_response, unexpected_error_response
from app.api.framing import SINGLE_VALUED, closes_after
from app.api.limits import BodyHolds
from app.api.metrics import Metrics
from app.api.oip.errors import reshape
from app.api.protocol import ANSWERED_STATUS
from app.api.statuses import status_for
from app.errors import ClientDisconnected, YolopipeError

log = logging.getLogger("yolopipe.api")

Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Headers, bytes]  # status, headers, body
ASGI = Callable[[dict, Any, Any], Awaitable[None]]
_NOTED = frozenset((*SINGLE_VALUED, b"connection"))


class Request:
    """What the front read of a taken request: its scope, the headers the server acts on (one
    value each; ``connection``'s values joined), and its ``receive`` (the body is read whole)."""

    __slots__ = ("headers", "params", "receive", "scope")

    def __init__(self, scope: dict, headers: dict[bytes, bytes], receive: Any) -> None:
        self.scope = scope
        self.headers = headers
        self.receive = receive
        self.params: Any = None  # what ``Route.prepare`` read

    def header(self, name: bytes) -> str | None:
        value = self.headers.get(name)
        return None if value is None else value.decode("latin-1")

    def media_type(self) -> str:
        """The Content-Type's media type, lower-cased ("" when none)."""
        return (self.header(b"content-type") or "").split(";")[0].strip().lower()


class Route:
    """One hot route: ``prepare`` (before the body is read: False sends the request to FastAPI)
    and ``answer`` (the body read; raises ``YolopipeError`` for an error answer)."""

    oip = False  # errors in the Open Inference Protocol's shape

    def prepare(self, request: Request, path_params: tuple[str, ...]) -> bool:
        raise NotImplementedError

    async def answer(self, request: Request, body: bytes) -> Answer:
        raise NotImplementedError


class HotPath:
    """The front: ``route(scope)`` finds the hot route a request is for (None: not one), and
    ``serve`` answers it, or hands it to ``fallback`` (the FastAPI app) untouched."""

    def __init__(self, routes: dict[str, Route], oip_route: Route, holds: BodyHolds, metrics: Metrics,
                 max_body_bytes: int) -> None:
        """``routes``: by exact path; ``oip_route``: ``/v2/models/{name}[/versions/{version}]/infer``."""
        self.routes = routes
        self.oip_route = oip_route
        self.holds = holds
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    def route(self, scope: dict) -> tuple[Route, tuple[str, ...]] | None:
        if scope["method"] != "POST" or scope.get("root_path"):
            return None
        path: str = scope["path"]
        raw = scope.get("raw_path")
        if raw is not None and raw != path.encode():  # a percent-escape: FastAPI's framing decides
            return None
        found = self.routes.get(path)
        if found is not None:
            return found, ()
        segments = path.split("/")  # "", "v2", "models", name[, "versions", version], "infer"
        if len(segments) not in (5, 7) or segments[1:3] != ["v2", "models"] or segments[-1] != "infer":
            return None
        names = (segments[3],) if len(segments) == 5 else (segments[3], segments[5])
        if len(segments) == 7 and segments[4] != "versions":
            return None
        if any(name in ("", ".", "..") for name in names):
            return None
        return self.oip_route, names

    async def serve(self, scope: dict, receive: Any, send: Any, route: Route, path_params: tuple[str, ...],
                    fallback: ASGI) -> None:
        start = time.perf_counter()
        request = _taken(scope, receive, route, path_params, self.holds, self.max_body_bytes)
        if request is None:
            await fallback(scope, receive, send)
            return
        status = 500  # if this dies before answering, that is what the client sees
        self.holds.count += 1
        try:
            body = await _read_body(receive)
            if body is None:  # the client went away while sending: nobody to answer
                status = scope.get("extensions", {}).get(ANSWERED_STATUS) or status_for(ClientDisconnected("gone"))
                await send({"type": "http.response.start", "status": status, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            status, headers, content = await _answer(route, request, body)
            if closes_after(scope):
                headers.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content})
        finally:
            self.holds.count -= 1
            self.metrics.observe_request(scope["path"], status, time.perf_counter() - start)


def _taken(scope: dict, receive: Any, route: Route, path_params: tuple[str, ...], holds: BodyHolds,
           max_body_bytes: int) -> Request | None:
    """The request when the hot path answers it, else None (FastAPI does, as before)."""
    noted: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        name = name.lower()
        if name in _NOTED:
            if name in noted:
                if name != b"connection":
                    return None  # two values: FastAPI's framing refuses it
                value = noted[name] + b"," + value
            noted[name] = value
    length = noted.get(b"content-length")
    if length is None or not length.isdigit() or int(length) > max_body_bytes or b"transfer-encoding" in noted:
        return None
    if holds.full():
        return None
    request = Request(scope, noted, receive)
    return request if route.prepare(request, path_params) else None


async def _read_body(receive: Any) -> bytes | None:
    """The whole body (its length is declared and within the limit, and the server keeps to it),
    or None when the client went away first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _answer(route: Route, request: Request, body: bytes) -> Answer:
    """The route's answer, or its error's, as FastAPI's error handlers and the OIP error shape
    would have written it."""
    try:
        return await route.answer(request, body)
    except YolopipeError as exc:
        exc.__traceback__ = None  # its frames hold the request's body
        if status_for(exc) >= 500:
            log.warning("%s %s -> %s: %s", request.scope["method"], request.scope["path"], exc.code, exc)
        return error_answer(exc, route.oip)
    except Exception as exc:
        log.error("unexpected error on %s %s", request.scope["method"], request.scope["path"], exc_info=exc)
        response = unexpected_error_response()
        return response.status_code, list(response.raw_headers), bytes(response.body)


def error_answer(exc: YolopipeError, oip: bool) -> Answer:
    """The answer to ``exc``, as ``app.api.errors`` writes it (reshaped for ``/v2``)."""
    response = error_response(exc)
    headers, body = list(response.raw_headers), bytes(response.body)
    if oip:
        body = reshape(body)
        headers = [(k, v) for k, v in headers if k != b"content-length"] + [(b"content-length", b"%d" % len(body))]
    return response.status_code, headers, body
