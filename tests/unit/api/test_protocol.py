"""``uvicorn_options``: the HTTP limits of ``Settings`` (here set through YOLOPIPE_* variables,
as an operator would) are the ones a real uvicorn server enforces; the options survive the
pickling that uvicorn's worker processes need. The full corpus is tests/e2e/test_hostile_http.py."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from app.api.errors import install_error_handlers
from app.api.protocol import JsonHttpToolsProtocol, uvicorn_options
from app.settings import Settings
from tests.net import free_port


@pytest.fixture()
def server(monkeypatch):
    monkeypatch.setenv("YOLOPIPE_MAX_URL_BYTES", "300")
    monkeypatch.setenv("YOLOPIPE_HEAD_TIMEOUT_S", "0.5")
    app = FastAPI()
    install_error_handlers(app)
    app.add_api_route("/ok", lambda: {"ok": True}, methods=["GET"])
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        **uvicorn_options(Settings())))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield port
    srv.should_exit = True
    thread.join(10)


def _ask(port: int, data: bytes) -> tuple[int, dict | bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
            if b"\r\n\r\n" in reply and (b"connection: close" not in reply.lower() or reply.endswith(b"}")):
                break
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head[9:12])
    return status, json.loads(body) if body.startswith(b"{") else body


def test_the_settings_limits_are_what_the_server_enforces(server):
    assert _ask(server, b"GET /ok?" + b"a" * 200 + b" HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
    status, body = _ask(server, b"GET /ok?" + b"a" * 400 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 414 and body["error"]["code"] == "uri_too_long" and "300 bytes" in body["error"]["message"]
    started = time.monotonic()
    status, body = _ask(server, b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # headers never complete
    assert status == 408 and body["error"]["code"] == "read_timeout" and time.monotonic() - started < 4.0


def test_the_options_survive_a_trip_to_a_worker_process():
    options = uvicorn_options(Settings(max_head_bytes=4096, keep_alive_s=7))
    config = uvicorn.Config(FastAPI(), **options)
    config.load()
    assert config.http_protocol_class.func is JsonHttpToolsProtocol  # type: ignore[attr-defined]
    assert config.timeout_keep_alive == 7 and config.h11_max_incomplete_event_size == 4096
    revived = pickle.loads(pickle.dumps(options["http"]))
    assert revived.func is JsonHttpToolsProtocol and revived.keywords["limits"].max_head_bytes == 4096
