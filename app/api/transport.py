"""The connection's transport as ``app.api.protocol.JsonHttpToolsProtocol`` and uvicorn's
request cycles see it:

- ``close()`` is the protocol's lingering close (``JsonHttpToolsProtocol._close``): while a
  request's body is still coming it ends the output and drops what the client still sends; the
  transport reads as closing from then on;
- a response's head and body leave in one write: uvicorn writes the head (status line and
  headers) as soon as the application starts its response, then the body; the head is held
  until the next write (the body, normally in the same step of the event loop) and sent with
  it, one segment on the wire instead of two. A head that nothing follows at once (a
  streaming response, HEAD, ``100 Continue``) leaves at the loop's next turn, and before any
  close.

Everything else is the transport's own.
"""

from __future__ import annotations

from typing import Any

_JOIN_BELOW = 1 << 16  # a smaller body is copied behind the head; a larger one is written beside it


class ConnectionTransport:
    def __init__(self, transport: Any, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol
        self._head: bytes | None = None  # a response head waiting for its body
        self._flush: Any = None  # the loop's callback that sends it alone

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._flush.cancel()
            if len(data) < _JOIN_BELOW:
                self._transport.write(head + data)
            else:
                self._transport.writelines((head, data))
            return
        if type(data) is bytes and data.startswith(b"HTTP/1.1 ") and data.endswith(b"\r\n\r\n"):  # a head
            self._head = data
            self._flush = self._protocol.loop.call_soon(self._send_head)
            return
        self._transport.write(data)

    def _send_head(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self._flush_head()
        self._protocol._close(self._transport)

    def close_now(self) -> None:
        self._transport.close()

    def write_eof(self) -> None:
        self._flush_head()
        self._transport.write_eof()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def _flush_head(self) -> None:
        if self._head is not None:
            self._flush.cancel()
            self._send_head()
