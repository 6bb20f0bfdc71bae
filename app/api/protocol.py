"""HTTP/1.1 defences that uvicorn leaves to the application, answered in the JSON error shape.

Uvicorn's httptools protocol has no limit on the request line or headers (httptools builds a
header by repeated concatenation: a 64 MB header stalled every connection for 2.6 s), no read
timeout (a client that stops mid-headers or mid-body is waited on forever) and answers
malformed requests with a ``text/plain`` 400. ``JsonHttpToolsProtocol`` subclasses it and adds:

- 414 when the request target passes ``max_url_bytes``, 431 when the request line and headers
  (or a chunked body's trailers) pass ``max_head_bytes``; at most one socket read (256 KB) is
  parsed past the limit, so the cost is bounded;
- 408 when the headers are not complete ``head_timeout_s`` after the request began (or the
  connection opened), or when no body bytes arrived for ``body_idle_timeout_s`` while the
  application waits for them; a connection that never sent a byte is closed without a word;
- 400 for malformed framing (bad chunk size, Content-Length with chunked, a negative or
  duplicate Content-Length, NUL in a header, an Upgrade request with a body, a TLS handshake
  on the plain port), 501 for an unknown method, 505 for an HTTP version other than 1.x (an
  HTTP/2 preface or ``HTTP/2.0`` request line included);
- pipelining kept in order: a request refused behind pipelined ones is answered after them
  (they run first, it never does); a request pipelined after an ``Upgrade`` one is served
  (no protocol is ever switched to here);
- a lingering close (RFC 9112 §9.6): a connection closed while its request's body is still
  coming (a 413 or 503 before the body is read) first ends its output after the answer, then
  reads and drops what the client still sends, for at most ``LINGER_S`` and ``LINGER_BYTES``.
  Closed at once, the unread bytes made the kernel answer with a reset, which destroys the
  answer the client has not read yet: every client that sent a body over the limit got a
  reset instead of its 413.

Each answer is ``{"error": {"code", "message"}}`` with ``connection: close``; the limits are
``Settings`` fields (``max_url_bytes``, ``max_head_bytes``, ``head_timeout_s``, ...). When the
application is already running for the request (a bad chunk mid-body), it is told the client
went away; ``BodyLimitMiddleware`` then counts the status answered here (or 499) in /metrics.
Everything else is uvicorn's. ``uvicorn_options(settings)`` is what the server passes to uvicorn.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.api.errors import error_body
from app.api.parser_errors import Refuse, parser_error
from app.api.statuses import status_for
from app.api.transport import ConnectionTransport
from app.errors import (
    BadRequest,
    HeadersTooLarge,
    HttpVersionNotSupported,
    ReadTimeout,
    UriTooLong,
    YolopipeError,
)
from app.settings import Settings

log = logging.getLogger("yolopipe.api.protocol")

# Where the status answered by the protocol is left for the middleware (ASGI scope extensions).
ANSWERED_STATUS = "yolopipe.answered_status"
# What the protocol offers each request (an ASGI scope extension): ``on_disconnect(callback)``
# has ``callback()`` called once if the client goes away before the request's answer is complete
# (``on_disconnect(None)``: no longer). Without it, an application learns of a hang-up only by
# waiting in ``receive`` (a task of its own per request).
ON_DISCONNECT = "yolopipe.on_disconnect"
LINGER_S = 5.0  # nginx's lingering_timeout
LINGER_BYTES = 16 << 20


@dataclass(frozen=True)
class HttpLimits:
    """Limits on what one request may make the server read and wait for (``Settings`` names
    and documents each; this is what the protocol holds, picklable for uvicorn's workers)."""

    max_url_bytes: int
    max_head_bytes: int
    head_timeout_s: float
    body_idle_timeout_s: float
    keep_alive_s: int

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpLimits:
        return cls(settings.max_url_bytes, settings.max_head_bytes, settings.head_timeout_s,
                   settings.body_idle_timeout_s, settings.keep_alive_s)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``/``uvicorn.run`` that put these defences in place,
    with the limits of ``settings``."""
    limits = HttpLimits.from_settings(settings)
    return {
        # A partial of a module-level class stays picklable for uvicorn's worker processes.
        "http": partial(JsonHttpToolsProtocol, limits=limits),
        "ws": "none",  # no WebSocket route: an Upgrade request is served as plain HTTP
        "timeout_keep_alive": limits.keep_alive_s,
        # The same header limit for anyone who overrides "http" with uvicorn's h11 (text/plain answers).
        "h11_max_incomplete_event_size": limits.max_head_bytes,
    }


class JsonHttpToolsProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol with limits, read timeouts and JSON protocol errors.

    ``self.pipeline`` is uvicorn's own attribute: its queue of the connection's pipelined
    requests (HTTP pipelining) that wait for the one running, as ``(cycle, app)`` pairs."""

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._in_head = True  # reading a request line and headers (or waiting for the next request)
        self._in_trailer = False  # after a chunk header, before its data: a last chunk's trailers
        self._head_bytes = 0
        self._request_begun = False  # a request line has started (else the connection is idle)
        self._received_any = False
        self._deferred: YolopipeError | None = None  # refused behind requests still being answered
        self._running: Any = None  # the cycle whose application task was started last
        self._completed = 0  # requests whose last byte was parsed
        self._head_timer: Any = None
        self._body_timer: Any = None
        self._last_body_at = 0.0
        self._grown: type | None = None  # the type uvicorn's request cycles grow a body in
        self._lingering = False
        self._lingered = 0  # bytes dropped while lingering
        self._linger_timer: Any = None

    # --- connection -------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        # Uvicorn's request cycles close the transport they are given: this one lingers (and
        # sends a response's head with its body).
        super().connection_made(ConnectionTransport(transport, self))
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._on_head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        # Uvicorn marks only the newest request gone; one still running behind it (pipelined, a
        # client that never reads) would write to the closed transport: uvloop raises, and the
        # log gets a traceback per request. Pipelined ones not started never run.
        running, queued, self.pipeline = self._running, [c for c, _ in self.pipeline], deque()
        for cycle in (running, *queued):
            if cycle is not None and not cycle.response_complete:
                _went_away(cycle)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a body nobody reads: dropped
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.transport.close_now()
            return
        self._unset_keepalive_if_required()
        if not self._received_any:
            self._received_any = True
            if data[:1] == b"\x16":  # a TLS ClientHello: answered in HTTP (what a client's log shows), closed
                self._refuse(BadRequest("a TLS handshake on the plain HTTP port: use http://, not https://"))
                return
        # Where a refused request's bytes begin in ``data``, when known: at its start, if no request
        # was begun before it and none ended inside it.
        began_here, completed = not self._request_begun, self._completed
        if self._in_head or self._in_trailer:
            self._head_bytes += len(data)
        while data:
            try:
                self.parser.feed_data(data)
                data = b""
            except httptools.HttpParserUpgrade as exc:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                    return
                # Served as plain HTTP (no protocol is switched to here; uvicorn would log two
                # warnings for each one); the parser stopped after it: parse what follows.
                log.debug("ignored an Upgrade request from %s", self.client)
                offset = exc.args[0] if exc.args and isinstance(exc.args[0], int) else len(data)
                data = data[offset:]
            except httptools.HttpParserError as exc:
                self._refuse(parser_error(exc, data if began_here and self._completed == completed else None))
                return
        if (self._in_head or self._in_trailer) and self._head_bytes > self.limits.max_head_bytes:
            self._refuse(HeadersTooLarge(f"request headers are over {self.limits.max_head_bytes:,} bytes"))
            return
        self._arm_timers(completed)

    def _arm_timers(self, completed: int) -> None:
        """The read timeouts of what this read left incomplete: armed once a read ends, not per
        request, so a request whose head and body came in one read never needs a timer.
        ``completed``: the requests completed before this read."""
        if self._in_head:
            # A head begun and not complete, or a read that held no request (blank lines): waited
            # on for ``head_timeout_s``. An idle connection between requests is uvicorn's keep-alive.
            if self._head_timer is None and (self._request_begun or self._completed == completed):
                self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._on_head_timeout)
        elif self._body_timer is None:  # a body still to come
            self._body_timer = self.loop.call_later(self.limits.body_idle_timeout_s, self._on_body_timeout)

    # --- parser callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._request_begun = True, True

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            raise Refuse(UriTooLong(f"the request target is over {self.limits.max_url_bytes:,} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:
            super().on_header(name, value)
            return
        # A trailer after a chunked body: counted against the header limit, not kept (uvicorn
        # would append it to the headers the application already holds).
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > self.limits.max_head_bytes:
            raise Refuse(HeadersTooLarge(f"request trailers are over {self.limits.max_head_bytes:,} bytes"))

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_head_bytes:
            raise Refuse(HeadersTooLarge(f"request headers are over {self.limits.max_head_bytes:,} bytes"))
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):  # llhttp reads HTTP/2.0 or 0.9 in a request line as valid
            raise Refuse(HttpVersionNotSupported(f"only HTTP/1.0 and HTTP/1.1 are served here (HTTP/{version})"))
        if self.parser.should_upgrade() and any(n in (b"content-length", b"transfer-encoding") for n, _ in self.headers):
            # llhttp would leave its body unread and parse it as the next request.
            raise Refuse(BadRequest("malformed HTTP request: an Upgrade request must not carry a body here"))
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        cycle = self.cycle
        if cycle.scope is self.scope:  # (uvicorn made a cycle for it: not a WebSocket upgrade)
            self.scope.setdefault("extensions", {})[ON_DISCONNECT] = partial(_on_disconnect, cycle)
        if not any(queued is cycle for queued, _ in self.pipeline):
            self._running = cycle  # started now, not queued behind another
        self._last_body_at = self.loop.time()

    def on_chunk_header(self) -> None:
        self._in_trailer, self._head_bytes = True, 0

    def on_chunk_complete(self) -> None:
        self._in_trailer = False

    def on_body(self, body: bytes) -> None:
        self._in_trailer = False
        self._last_body_at = self.loop.time()
        cycle = self.cycle
        if not cycle.body and not cycle.response_complete and not self.parser.should_upgrade():
            # The first piece is kept as the bytes it came in, which uvicorn's receive hands on
            # as they are: a body that arrives in one read is never copied (uvicorn grew a
            # bytearray with it, then copied that to bytes).
            if self._grown is None:
                self._grown = type(cycle.body)  # what this uvicorn grows a body in
            cycle.body = body
            if len(body) > HIGH_WATER_LIMIT:
                self.flow.pause_reading()
            cycle.message_event.set()
            return
        if type(cycle.body) is bytes and self._grown is bytearray:
            cycle.body = bytearray(cycle.body)  # a second piece: grown as uvicorn grows it
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._in_head, self._in_trailer, self._request_begun, self._head_bytes = True, False, False, 0
        self._completed += 1
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._deferred is None:
            self._start_next_pipelined()
            return
        if self.pipeline:  # requests before the refused one are still to be answered, in order
            self._start_next_pipelined()
            self.flow.pause_reading()
            return
        deferred, self._deferred = self._deferred, None
        self.server_state.total_requests += 1
        self._answer_and_close(deferred)

    def _start_next_pipelined(self) -> None:
        """Uvicorn's end of a response, which starts the next pipelined request, if any: noted
        here as the one running (uvicorn names no hook for this in every version it allows)."""
        queued = self.pipeline[-1][0] if self.pipeline else None
        super().on_response_complete()
        if queued is not None and not any(cycle is queued for cycle, _ in self.pipeline):
            self._running = queued

    # --- timeouts ---------------------------------------------------------------------------
    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if not self._request_begun:  # nothing of a request arrived: an idle connection
            self.transport.close()
            return
        self._refuse(ReadTimeout(f"request headers not complete within {self.limits.head_timeout_s:g} s"))

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        idle = self.loop.time() - self._last_body_at
        # Reading is paused while the application has not consumed what came: not the client's fault.
        if self.flow.read_paused or idle < self.limits.body_idle_timeout_s:
            wait = self.limits.body_idle_timeout_s - (0.0 if self.flow.read_paused else idle)
            self._body_timer = self.loop.call_later(max(wait, 0.05), self._on_body_timeout)
            return
        self._refuse(ReadTimeout(f"no request body bytes for {self.limits.body_idle_timeout_s:g} s"))

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._linger_timer = None

    # --- closing ----------------------------------------------------------------------------
    def _close(self, transport: Any) -> None:
        """``transport.close()`` as the protocol and uvicorn's cycles call it: lingering while the
        request's body is still coming (its headers read, its last byte not), else at once."""
        if self._lingering or transport.is_closing():
            return
        if self._in_head or not transport.can_write_eof():
            transport.close()
            return
        self._cancel_timers()
        self._lingering = True
        transport.write_eof()  # the answer is whole: the client reads it, then its end
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    # --- answering --------------------------------------------------------------------------
    def _refuse(self, error: YolopipeError) -> None:
        """Answer ``error`` as JSON and close, unless a response is already on the wire."""
        self._cancel_timers()
        if self.transport.is_closing():
            return
        cycle = self.cycle if not self._in_head else None  # the request refused, when its head was read
        if cycle is not None and any(queued is cycle for queued, _ in self.pipeline):
            # Pipelined behind others and not started: it never runs.
            self.pipeline = deque(entry for entry in self.pipeline if entry[0] is not cycle)
            cycle = None
        if cycle is not None and cycle.response_started:
            self.transport.close()  # the request was answered (or is being answered) already
            return
        running = self._running
        if self.pipeline or (running is not None and running is not cycle and not running.response_complete):
            # Earlier requests on this connection are still being answered: this answer goes after them.
            self._deferred = error
            self.flow.pause_reading()
            return
        if cycle is not None and not cycle.response_complete:
            # The application is reading this request's body: it sees a disconnect, sends nothing.
            cycle.scope.setdefault("extensions", {})[ANSWERED_STATUS] = status_for(error)  # type: ignore[typeddict-item]
            _went_away(cycle)
        self._answer_and_close(error)

    def _answer_and_close(self, error: YolopipeError) -> None:
        status = status_for(error)
        log.debug("refused a request from %s: %s %s", self.client, status, error.message)
        body = json.dumps(error_body(error.code, error.message)).encode()
        head = [STATUS_LINE[status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def _on_disconnect(cycle: Any, callback: Any) -> None:
    cycle.yolopipe_on_disconnect = callback


def _went_away(cycle: Any) -> None:
    """A request's client is gone: its application hears it (``receive``, ``ON_DISCONNECT``)."""
    cycle.disconnected = True
    cycle.message_event.set()
    callback = getattr(cycle, "yolopipe_on_disconnect", None)
    if callback is not None:
        cycle.yolopipe_on_disconnect = None
        callback()
