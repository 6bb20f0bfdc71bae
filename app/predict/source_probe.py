"""Before FFmpeg opens an RTSP source: does its server answer at all?

FFmpeg's open cannot be interrupted from outside: a camera that accepts and never answers (or
a host that drops packets) holds the reading thread until the open timeout, and removing the
stream meanwhile could not stop it. So an ``rtsp``/``rtsps`` source is first probed here, on a
socket of our own that a stop ends at once: a TCP connect and RTSP's first exchange (an
``OPTIONS`` request, which opens no session; for ``rtsps`` the TLS handshake), each answer
awaited at most the open timeout. Only a server that answered is handed to FFmpeg.

Other schemes are not probed: an HTTP or RTMP server may serve one client only (``ffmpeg
-listen 1``), which a probe would use up; ``srt`` is UDP. Their opens still run at once beside
the others (``app.predict.sources``); a removed one still opening ends with its open timeout.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable

from app.source_urls import SourceUrl

DEFAULT_PORTS = {"rtsp": 554, "rtsps": 322}  # the schemes probed (see the module docstring)
_POLL_S = 0.05  # how often a waiting probe looks at its stop flag


class Stopped(Exception):
    """The probe's stop flag was set: the stream is being removed."""


def probe(url: SourceUrl, timeout_s: float, stopped: Callable[[], bool]) -> str | None:
    """None when the server of ``url`` answered within ``timeout_s``, or its scheme is not probed;
    else why not, fit to show (no credentials). Raises ``Stopped`` within ``_POLL_S`` of
    ``stopped()`` becoming true."""
    if url.scheme not in DEFAULT_PORTS:
        return None
    port = url.port or DEFAULT_PORTS[url.scheme]
    where = f"{url.host}:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        addresses = _resolve(url.host, port, deadline, stopped)
    except OSError as exc:
        return f"cannot resolve {url.host}: {exc.strerror or exc}"
    if addresses is None:
        return f"{url.host} did not resolve within {timeout_s:g} s"
    reason = f"cannot connect to {where}"
    for family, address in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            if not _connect(sock, address, deadline, stopped):
                reason = f"no connection to {where} within {timeout_s:g} s"
                continue
            answered = _first_exchange(sock, url, deadline, stopped)
            if answered is None:
                return f"{where} accepted the connection but did not answer within {timeout_s:g} s"
            return None if answered else f"{where} closed the connection without answering"
        except OSError as exc:
            reason = f"cannot connect to {where}: {exc.strerror or exc}"
        finally:
            sock.close()
    return reason


def _resolve(host: str, port: int, deadline: float, stopped: Callable[[], bool]) -> list[tuple[int, tuple]] | None:
    """The addresses of ``host``, resolved on a thread of its own (the resolver has no timeout
    and cannot be stopped; a stop or the deadline leaves it behind). None past the deadline."""
    found: list = []
    error: list[OSError] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            found.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            error.append(exc)
        done.set()

    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        lookup()  # a literal address: nothing to wait for
    except OSError:
        threading.Thread(target=lookup, name="yolopipe-resolve", daemon=True).start()
    while not done.wait(_POLL_S):
        if stopped():
            raise Stopped
        if time.monotonic() > deadline:
            return None
    if error:
        raise error[0]
    return [(family, address) for family, _type, _proto, _name, address in found]


def _wait(sock: socket.socket, writable: bool, deadline: float, stopped: Callable[[], bool]) -> bool:
    """Whether ``sock`` became readable (or writable) before the deadline."""
    while True:
        if stopped():
            raise Stopped
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        wanted = ([], [sock], []) if writable else ([sock], [], [])
        ready = select.select(*wanted, min(left, _POLL_S))
        if ready[1 if writable else 0]:
            return True


def _connect(sock: socket.socket, address: tuple, deadline: float, stopped: Callable[[], bool]) -> bool:
    err = sock.connect_ex(address)
    if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
        raise OSError(err, os.strerror(err))
    if err and not _wait(sock, True, deadline, stopped):
        return False
    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))
    return True


def _first_exchange(sock: socket.socket, url: SourceUrl, deadline: float, stopped: Callable[[], bool]) -> bool | None:
    """Whether the server answered RTSP's first message (False: it closed without a byte); None
    when nothing came before the deadline."""
    if url.scheme == "rtsps":
        return _tls_handshake(sock, url.host, deadline, stopped)
    sock.sendall(f"OPTIONS {url.request_target} RTSP/1.0\r\nCSeq: 1\r\nUser-Agent: yolopipe\r\n\r\n".encode())
    if not _wait(sock, False, deadline, stopped):
        return None
    try:
        return bool(sock.recv(1))
    except ConnectionError:
        return False


def _tls_handshake(sock: socket.socket, host: str, deadline: float, stopped: Callable[[], bool]) -> bool | None:
    # Only whether a TLS server answers; FFmpeg makes (and checks) the real connection.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    tls = context.wrap_socket(sock, server_hostname=None if ":" in host or host[-1:].isdigit() else host,
                              do_handshake_on_connect=False)
    try:
        while True:
            try:
                tls.do_handshake()
                return True
            except ssl.SSLWantReadError:
                if not _wait(tls, False, deadline, stopped):
                    return None
            except ssl.SSLWantWriteError:
                if not _wait(tls, True, deadline, stopped):
                    return None
            except ssl.SSLEOFError:
                return False
            except ssl.SSLError:
                return True  # it answered, if not to our liking: FFmpeg will say what it thinks
            except ConnectionError:
                return False
    finally:
        tls.detach()
