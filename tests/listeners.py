"""TCP listeners on loopback that play a video source's server badly: one that accepts and never
answers (the camera that holds an open until its timeout), one that hangs up, one that answers
the first bytes it hears."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def listener(answer: bytes | None = None, hang_up: bool = False) -> Iterator[tuple[int, list[bytes]]]:
    """A TCP listener on loopback: answers ``answer`` to the first bytes it reads, hangs up at
    once (``hang_up``), or (neither) accepts and never says a word. Yields its port and what it read."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    heard: list[bytes] = []
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            if hang_up:
                conn.close()
                continue
            held.append(conn)
            if answer is not None:
                conn.settimeout(2)
                heard.append(conn.recv(4096))
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], heard
    finally:
        stop.set()
        thread.join(2)
        for conn in held:
            conn.close()
        server.close()
