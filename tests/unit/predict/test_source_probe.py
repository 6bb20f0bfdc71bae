"""Does an RTSP source's server answer (``app.predict.source_probe``)? Against real listeners on
loopback: one that accepts and never answers, one that speaks RTSP, one that hangs up, a port
nobody listens on; a probe stopped while it waits; schemes that are not probed."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from app.predict.source_probe import Stopped, probe
from app.source_urls import parse_url
from tests.listeners import listener


def never() -> bool:
    return False


def test_a_listener_that_never_answers_is_reported_after_the_timeout():
    with listener() as silent_server:
        port = silent_server.port
        start = time.monotonic()
        reason = probe(parse_url(f"rtsp://user:secret@127.0.0.1:{port}/a"), 0.5, never)
        assert 0.45 < time.monotonic() - start < 2.0
    assert reason == f"127.0.0.1:{port} accepted the connection but did not answer within 0.5 s"


def test_an_rtsp_server_that_answers_passes_and_hears_options_without_credentials():
    with listener(b"RTSP/1.0 200 OK\r\nCSeq: 1\r\n\r\n") as server:
        port, heard = server.port, server.heard
        assert probe(parse_url(f"rtsp://user:secret@127.0.0.1:{port}/live?ch=1"), 2.0, never) is None
    assert heard == [f"OPTIONS rtsp://127.0.0.1:{port}/live?ch=1 RTSP/1.0\r\nCSeq: 1\r\nUser-Agent: yolopipe\r\n\r\n"
                     .encode()]


@pytest.mark.parametrize("scheme", ["http", "https", "rtmp", "srt"])
def test_servers_that_may_serve_one_client_only_are_not_probed(scheme):
    """An ``ffmpeg -listen 1`` server serves one client: a probe would use it up."""
    with listener(b"x") as server:
        assert probe(parse_url(f"{scheme}://127.0.0.1:{server.port}/a"), 2.0, never) is None
        assert server.accepted == 0


def test_a_server_that_hangs_up_and_a_closed_port_are_reported():
    with listener(hang_up=True) as server:
        port = server.port
        assert probe(parse_url(f"rtsp://127.0.0.1:{port}/a"), 2.0, never) == \
            f"127.0.0.1:{port} closed the connection without answering"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        reason = probe(parse_url(f"rtsp://127.0.0.1:{port}/a"), 2.0, never)
    assert reason is not None and reason.startswith(f"cannot connect to 127.0.0.1:{port}")


def test_a_tls_source_that_never_answers_its_handshake_is_reported():
    with listener() as silent_server:
        port = silent_server.port
        reason = probe(parse_url(f"rtsps://127.0.0.1:{port}/a"), 0.3, never)
    assert reason is not None and "did not answer" in reason


def test_a_stop_ends_a_waiting_probe_at_once():
    with listener() as silent_server:
        port = silent_server.port
        stop = threading.Event()
        threading.Timer(0.2, stop.set).start()
        start = time.monotonic()
        with pytest.raises(Stopped):
            probe(parse_url(f"rtsp://127.0.0.1:{port}/a"), 30.0, stop.is_set)
        assert time.monotonic() - start < 1.0


