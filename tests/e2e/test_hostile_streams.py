"""``/v1/streams`` against a real ``yolopipe serve`` (CPU backend), tried as an attacker would:
cameras that never answer, sources with control characters and credentials, requests that
mean nothing, SSE clients that never read. Raw sockets and real clients on loopback.

A source that never answers is a real listener here that accepts and never says a word. The
server's open timeout is made long (``SILENT_S``), so that on a loaded machine "did not wait for
the silent source" is told apart from "was slow": the silent stream is still in its first open
(``connecting``) when the other stream's first frame arrives, which waiting would have ended."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.listeners import listener
from tests.videos import write_clip

CLI = [sys.executable, "-m", "app.cli"]
MAX_STREAMS = 6
SILENT_S = 120.0  # the server's stream open timeout
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, artifacts_dir, assets_dir):
    videos = tmp_path_factory.mktemp("served")
    write_clip(videos / "clip.avi", assets_dir, 100)  # 10 s at 10 fps: long enough for a loaded CPU
    port = free_port()
    log = videos / "server.log"
    env = {**os.environ, "YOLOPIPE_ARTIFACTS_DIR": str(artifacts_dir), "YOLO_OFFLINE": "1",
           "YOLOPIPE_STREAM_FILES_ROOT": str(videos), "YOLOPIPE_MAX_STREAMS": str(MAX_STREAMS),
           "YOLOPIPE_WORKERS": "1", "YOLOPIPE_STANDBY": "false", "YOLOPIPE_STREAM_OPEN_TIMEOUT_S": str(SILENT_S)}
    with log.open("w") as out:
        proc = subprocess.Popen([*CLI, "serve", "--backend", "onnxruntime", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.25)
    yield base, port, log
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(autouse=True)
def no_streams_left(server):
    yield
    base = server[0]
    for stream in httpx.get(f"{base}/v1/streams", timeout=30).json()["streams"]:
        httpx.delete(f"{base}/v1/streams/{stream['id']}", timeout=30)


def add(base: str, source: str, **fields) -> httpx.Response:
    return httpx.post(f"{base}/v1/streams", json={"source": source, **fields}, timeout=30)


def first_event_seconds(base: str, source: str = "clip.avi") -> float:
    """Seconds from asking for a stream of ``source`` to its first processed frame over SSE; the
    stream is removed then (it would compete with the next one)."""
    start = time.monotonic()
    r = add(base, source)
    assert r.status_code == 201, r.text
    try:
        with httpx.stream("GET", f"{base}/v1/streams/{r.json()['id']}/events", timeout=60) as events:
            for line in events.iter_lines():
                if line.startswith("data: "):
                    assert "end" not in json.loads(line[6:]), line
                    return time.monotonic() - start
        raise AssertionError("no event")
    finally:
        httpx.delete(f"{base}/v1/streams/{r.json()['id']}", timeout=30)
        wait_idle(base)  # its frames already in a batch still run: the next measurement waits them out


def wait_idle(base: str) -> None:
    """Until the inference worker has had nothing queued for half a second."""
    deadline, idle_since = time.monotonic() + 120, None
    while idle_since is None or time.monotonic() - idle_since < 0.5:
        assert time.monotonic() < deadline
        depth = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
                    if line.startswith("yolopipe_queue_depth"))
        idle_since = (idle_since or time.monotonic()) if depth == 0 else None
        time.sleep(0.05)


def state(base: str, stream_id: str) -> str:
    return httpx.get(f"{base}/v1/streams/{stream_id}", timeout=30).json()["state"]


def test_a_silent_source_delays_no_other_stream_even_after_100_removals(server):
    base, _, _ = server
    alone = first_event_seconds(base)
    with listener() as camera:
        silent = add(base, f"rtsp://127.0.0.1:{camera.port}/a").json()["id"]
        time.sleep(0.5)
        beside = first_event_seconds(base)
        assert state(base, silent) == "connecting"  # still in its first open: nobody waited for it
        for _ in range(100):
            r = add(base, f"rtsp://127.0.0.1:{camera.port}/b")
            assert r.status_code == 201, r.text
            assert httpx.delete(f"{base}/v1/streams/{r.json()['id']}", timeout=30).status_code == 204
        after = first_event_seconds(base)
        assert state(base, silent) == "connecting"
        deadline = time.monotonic() + 5
        while camera.open_connections() > 1:  # each removal closed its connection to the camera
            assert time.monotonic() < deadline, camera.open_connections()
            time.sleep(0.05)
        listed = httpx.get(f"{base}/v1/streams", timeout=30).json()["streams"]
        assert [s["id"] for s in listed] == [silent]
    print(f"first frame: alone {alone:.2f} s, beside a silent source {beside:.2f} s, after 100 removals {after:.2f} s")
    if alone < 0.5:  # a machine not loaded by others: the issue's own figure
        assert beside < 1.0 and after < 1.0, (alone, beside, after)


def test_delete_stops_an_open_in_progress_at_once(server):
    base, _, _ = server
    with listener() as camera:
        r = add(base, f"rtsp://127.0.0.1:{camera.port}/a")
        deadline = time.monotonic() + 5
        while camera.open_connections() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.delete(f"{base}/v1/streams/{r.json()['id']}", timeout=30).status_code == 204
        removed = time.monotonic()
        while camera.open_connections():
            assert time.monotonic() - removed < 1.0, "the open went on after its stream was removed"
            time.sleep(0.02)


def test_the_url_a_camera_hears_is_the_url_that_was_checked_without_credentials(server):
    base, _, log = server
    with listener(b"RTSP/1.0 200 OK\r\nCSeq: 1\r\nPublic: OPTIONS, DESCRIBE\r\n\r\n") as camera:
        sent = f"RTSP://admin:hunter2@127.0.0.1:0{camera.port}/Live?ch=1"
        checked = f"rtsp://127.0.0.1:{camera.port}/Live?ch=1"
        r = add(base, sent)
        assert r.status_code == 201 and r.json()["source"] == f"rtsp://***@127.0.0.1:{camera.port}/Live?ch=1"
        deadline = time.monotonic() + 20
        while len(camera.heard) < 2:  # the probe's OPTIONS, then FFmpeg's own
            assert time.monotonic() < deadline, camera.heard
            time.sleep(0.05)
        for first in camera.heard:
            assert first.split(b"\r\n", 1)[0] == f"OPTIONS {checked} RTSP/1.0".encode(), camera.heard
        listed = httpx.get(f"{base}/v1/streams", timeout=30).text
        one = httpx.get(f"{base}/v1/streams/{r.json()['id']}", timeout=30).text
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    for shown in (r.text, listed, one, metrics, log.read_text()):
        assert "hunter2" not in shown and "admin" not in shown


@pytest.mark.parametrize("char, named", [("\r", "U+000D"), ("\x00", "U+0000"), ("\t", "U+0009"), ("\x7f", "U+007F"),
                                         (" ", "U+0020"), ("\u2028", "U+2028"), ("\x0b", "U+000B"),
                                         ("\u200b", "U+200B")])
def test_a_control_character_or_whitespace_in_a_source_is_a_422_naming_it(server, char, named):
    base, _, _ = server
    with listener() as camera:
        r = add(base, f"rtsp://127.0.0.1:{camera.port}/a{char}X-Injected: 1")
        time.sleep(0.3)
        assert camera.accepted == 0  # nothing reached the camera
    assert r.status_code == 422 and named in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("source, why", [
    ("rtsp://cam/a#x", "fragment"), ("rtsp://u@evil@cam/a", "more than one '@'"),
    ("rtsp://[fe80::1%25lo]:554/a", "zone"), ("rtsp://\u0441am/a", "non-ASCII"), ("RTSPS://cam:70000/a", "port"),
    ("gopher://cam/a", "scheme not allowed"), ("rtsp://cam/%G0", "bad %-escape"),
])
def test_urls_that_could_be_read_two_ways_are_422(server, source, why):
    r = add(server[0], source)
    assert r.status_code == 422 and why in r.json()["error"]["message"], r.text


def raw_post(port: int, body: bytes, headers: dict | None = None) -> tuple[int, dict, float]:
    head = [b"POST /v1/streams HTTP/1.1", b"Host: t", b"Content-Type: application/json"]
    head += [f"{k}: {v}".encode() for k, v in (headers or {"Content-Length": len(body)}).items()]
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        except OSError:  # answered and closed before all of it was read: what it answered is read below
            pass
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data[9:12]), json.loads(data.partition(b"\r\n\r\n")[2]), time.monotonic() - start


def _length(data: bytes) -> int:
    head = data.partition(b"\r\n\r\n")[0]
    lengths = (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return next(lengths, 0)


def test_request_bodies_that_mean_nothing_are_refused(server):
    base, port, _ = server
    status, body, seconds = raw_post(port, b'{"source": "clip.avi", "pad": "' + b"a" * 10_000_000 + b'"}')
    assert status == 413 and "4,096" in body["error"]["message"] and seconds < 5
    parts = [b'{"source": "'] + [b"a" * 65536] * 8
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"
    status, body, _ = raw_post(port, chunks, {"Transfer-Encoding": "chunked"})
    assert status == 413, body
    r = add(base, "clip.avi", vid_strde=5)
    assert r.status_code == 422 and "vid_strde" in r.json()["error"]["message"]
    r = add(base, "clip.avi", vid_stride="5")
    assert r.status_code == 422 and "vid_stride" in r.json()["error"]["message"]
    assert httpx.post(f"{base}/v1/streams?vid_stride=5", json={"source": "clip.avi"}, timeout=30).status_code == 422


def test_many_pending_opens_are_bounded_and_go_when_removed(server):
    base, _, _ = server
    with listener() as camera:
        ids = []
        for k in range(MAX_STREAMS):
            r = add(base, f"rtsp://127.0.0.1:{camera.port}/{k}")
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        r = add(base, "clip.avi")
        assert r.status_code == 422 and f"at most {MAX_STREAMS} streams" in r.json()["error"]["message"]
        for stream_id in ids:
            assert httpx.delete(f"{base}/v1/streams/{stream_id}", timeout=30).status_code == 204
        first_event_seconds(base)  # a place is free at once: no removed open holds one


def test_sse_clients_that_never_read_cost_the_others_nothing(server):
    base, port, _ = server
    r = add(base, "clip.avi")
    stream_id = r.json()["id"]
    stalled = []
    for _ in range(20):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET /v1/streams/{stream_id}/events HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        stalled.append(sock)  # never read
    try:
        events, kind = [], None
        with httpx.stream("GET", f"{base}/v1/streams/{stream_id}/events", timeout=60) as reader:
            for line in reader.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if kind == "end":
                        break
                    healthz = time.monotonic()
                    assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
                    assert time.monotonic() - healthz < 2.0
        assert kind == "end" and len(events) >= 3  # the stream ran to its end for the client that reads
    finally:
        for sock in stalled:
            sock.close()
    assert httpx.get(f"{base}/v1/streams/{stream_id}", timeout=30).json()["state"] == "ended"


def test_head_and_encoded_paths_on_the_streams_api(server):
    base, _, _ = server
    r = httpx.head(f"{base}/v1/streams", timeout=30)
    assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) > 0
    stream_id = add(base, "clip.avi").json()["id"]
    r = httpx.head(f"{base}/v1/streams/{stream_id}/events", timeout=30)  # SSE: headers, then done
    assert r.status_code == 200 and r.content == b"" and r.headers["content-type"].startswith("text/event-stream")
    assert httpx.get(f"{base}/v1/streams/{stream_id}%2Fevents", timeout=30).status_code == 404
    assert httpx.delete(f"{base}/v1/streams/{stream_id}", timeout=30).status_code == 204


def test_after_all_that_no_server_error_and_no_traceback(server):
    base, _, log = server
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    counted = [line for line in metrics.splitlines() if line.startswith("yolopipe_requests_total")]
    errors = [line for line in counted if 'status="5' in line and 'path="/readyz"' not in line]  # readyz: starting
    assert counted and not errors, errors
    text = Path(log).read_text()
    assert [line for line in text.splitlines() if "Traceback" in line or line.startswith("ERROR")] == [], text[-3000:]
