"""TCP listeners on loopback that play a video source's server badly: one that accepts and never
answers (the camera that holds an open until its timeout), one that hangs up, one that answers
the first bytes each connection sends and then says nothing more."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Listener:
    port: int
    heard: list[bytes] = field(default_factory=list)  # the first bytes of each connection (answering mode)
    held: list[socket.socket] = field(default_factory=list)
    accepted: int = 0

    def open_connections(self) -> int:
        """Connections the client has not closed yet (what each sent is read and dropped)."""
        still = 0
        for conn in list(self.held):
            try:
                conn.setblocking(False)
                while conn.recv(65536):
                    pass
            except BlockingIOError:
                still += 1  # nothing more to read, and no end of stream: open
            except OSError:
                pass
        return still


@contextmanager
def listener(answer: bytes | None = None, hang_up: bool = False) -> Iterator[Listener]:
    """A TCP listener on loopback: answers ``answer`` to the first bytes each connection sends,
    hangs up at once (``hang_up``), or (neither) accepts and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(256)
    found = Listener(server.getsockname()[1])
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            found.accepted += 1
            if hang_up:
                conn.close()
                continue
            found.held.append(conn)
            if answer is not None:
                conn.settimeout(2)
                try:
                    found.heard.append(conn.recv(4096))
                    conn.sendall(answer)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join(2)
        for conn in found.held:
            conn.close()
        server.close()
