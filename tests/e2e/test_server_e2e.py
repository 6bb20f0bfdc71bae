"""A real ``yolopipe serve`` on loopback (CPU backend, sample model): the supervisor, its HTTP
workers and its inference workers as real processes; killed, replaced and stopped for real."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.net import free_port, wait_ready

CLI = [sys.executable, "-m", "app.cli"]
JPEG = {"content-type": "image/jpeg"}


def start_server(artifacts_dir: Path, log: Path, **env: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    full_env = {**os.environ, "YOLOPIPE_ARTIFACTS_DIR": str(artifacts_dir), "YOLO_OFFLINE": "1",
                "YOLOPIPE_MAX_WAIT_MS": "5", **env}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*CLI, "serve", "--backend", "onnxruntime", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=full_env,
        )
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, log)
    return base, proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def inference_pids(base: str) -> list[int]:
    return [w["pid"] for w in httpx.get(f"{base}/v1/model", timeout=10).json()["serving"]["inference_workers"]]


def wait_for_standby(base: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(w["standby_ready"] for w in httpx.get(f"{base}/v1/model", timeout=10).json()["serving"]
                  ["inference_workers"]):
        assert time.monotonic() < deadline, "the warm standby never got ready"
        time.sleep(0.1)


def http_worker_pids(proc: subprocess.Popen, base: str) -> set[int]:
    """The supervisor's children that listen on the service's port (not the inference workers,
    their standbys or multiprocessing's resource tracker)."""
    port = int(base.rsplit(":", 1)[1])
    pids = set()
    for child in psutil.Process(proc.pid).children():
        try:
            connections = getattr(child, "net_connections", None) or child.connections  # psutil < 6 (kserve's pin)
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections("tcp")):
                pids.add(child.pid)
        except psutil.Error:  # gone meanwhile (the killed one)
            pass
    return pids


def metric(base: str, prefix: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    """Two HTTP workers, one inference worker."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    base, proc = start_server(artifacts_dir, log, YOLOPIPE_WORKERS="2")
    try:
        yield base, proc, log
    finally:
        stop(proc)


def test_detect_equals_yolopipe_predict(server, assets_dir, artifacts_dir, tmp_path):
    base, _, _ = server
    bus = assets_dir / "bus.jpg"
    r = httpx.post(f"{base}/v1/detect", files={"image": ("bus.jpg", bus.read_bytes(), "image/jpeg")}, timeout=60)
    assert r.status_code == 200, r.text
    served = r.json()

    out = tmp_path / "bus.jsonl"
    proc = subprocess.run(
        [*CLI, "predict", str(bus), "--weights", "sample", "--backend", "onnxruntime",
         "--artifacts-dir", str(artifacts_dir), "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "YOLO_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    (predicted,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert predicted["detections"], "the reference must have detections for the comparison to mean anything"
    assert {k: served[k] for k in ("width", "height", "detections")} == {
        k: predicted[k] for k in ("width", "height", "detections")
    }


def test_concurrent_clients_all_succeed_and_metrics_add_up_across_processes(server, assets_dir):
    base, _, _ = server
    images = [(assets_dir / n).read_bytes() for n in ("bus.jpg", "zidane.jpg")]
    before = metric(base, 'yolopipe_requests_total{path="/v1/detect",status="200"}')
    results: list[httpx.Response] = []

    def client(i: int) -> None:
        results.append(httpx.post(f"{base}/v1/detect", content=images[i % 2], headers=JPEG, timeout=120))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 6
    # Each new connection lands on either HTTP worker; /metrics (from either) counts all six.
    assert metric(base, 'yolopipe_requests_total{path="/v1/detect",status="200"}') == before + 6


def read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body[:length])


def test_oversized_body_is_refused_before_it_is_read(server):
    base, _, _ = server
    port = int(base.rsplit(":", 1)[1])
    # Declared too large: 413 comes back before a byte of the body is sent.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/detect HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                     b"Content-Length: 22020096\r\n\r\n")
        status, body = read_response(sock)
    assert status == 413 and body["error"]["code"] == "image_too_large"
    # Not declared (chunked): refused once the limit is passed while the body streams in.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/detect HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")

        def send_chunks() -> None:
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b"\xff" * (1 << 20))
            try:
                for _ in range(22):
                    sock.sendall(chunk)
            except OSError:
                pass  # the server stopped reading once it had answered

        sender = threading.Thread(target=send_chunks)
        sender.start()
        status, body = read_response(sock)
        sender.join(30)
    assert status == 413 and body["error"]["code"] == "image_too_large"
    assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200


def test_killed_inference_worker_fails_in_flight_requests_at_once_and_comes_back(server, assets_dir):
    base, proc, log = server
    bus = (assets_dir / "bus.jpg").read_bytes()
    wait_for_standby(base)
    (victim,) = inference_pids(base)
    answers: list[tuple[float, float, int | str]] = []  # sent, answered, status
    stop_load = threading.Event()

    def load() -> None:
        while not stop_load.is_set():
            sent = time.monotonic()
            try:
                status: int | str = httpx.post(f"{base}/v1/detect", content=bus, headers=JPEG, timeout=60).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            answers.append((sent, time.monotonic(), status))

    clients = [threading.Thread(target=load) for _ in range(4)]
    for t in clients:
        t.start()
    time.sleep(3.0)  # requests in flight and queued at the worker
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    deadline = killed_at + 120
    while time.monotonic() < deadline:  # the first 200 of a request sent after the kill
        if any(s == 200 and sent > killed_at for sent, _, s in answers):
            break
        time.sleep(0.01)
    back_at = time.monotonic()
    stop_load.set()
    for t in clients:
        t.join(90)
    # The warm standby took over (no cold start): the supervisor says so. How soon is a benchmark's
    # figure (bench/results); the bound here only tells a standby from a restart on a slow machine.
    print(f"served again {back_at - killed_at:.2f} s after the kill")
    assert "its standby takes over" in log.read_text(), log.read_text()[-3000:]
    assert back_at - killed_at < 15.0, (back_at - killed_at, log.read_text()[-3000:])
    statuses = {s for _, _, s in answers}
    assert statuses <= {200, 503}, statuses  # no timeouts, no 500s, no dropped connections
    in_flight = [(sent, answered, s) for sent, answered, s in answers if sent < killed_at < answered]
    assert in_flight and all(s == 503 for _, _, s in in_flight), in_flight
    assert all(answered - killed_at < 10.0 for _, answered, _ in in_flight)  # at once, not at the 30 s timeout
    r = httpx.post(f"{base}/v1/detect", content=bus, headers=JPEG, timeout=60)
    assert r.status_code == 200 and r.json()["detections"]
    assert inference_pids(base) != [victim]
    assert metric(base, 'yolopipe_worker_restarts_total{worker="0"}') == 1
    wait_for_standby(base)  # and a new standby warms up for the next time


def test_killed_http_worker_is_replaced(server, assets_dir):
    base, proc, log = server
    bus = (assets_dir / "bus.jpg").read_bytes()
    before = http_worker_pids(proc, base)
    assert len(before) == 2
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = http_worker_pids(proc, base)  # the other worker answers /v1/model meanwhile
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no replacement HTTP worker:\n{log.read_text()[-3000:]}")
    statuses = [httpx.post(f"{base}/v1/detect", content=bus, headers=JPEG, timeout=60).status_code for _ in range(4)]
    assert statuses == [200] * 4


def test_sigterm_finishes_in_flight_work_and_exits_cleanly(server, assets_dir):
    """Last in this module: it stops the server."""
    base, proc, log = server
    bus = (assets_dir / "bus.jpg").read_bytes()
    run_folder = Path(re.search(r"run folder (\S+)", log.read_text()).group(1))
    assert run_folder.is_dir()
    in_flight: list[httpx.Response] = []
    # A batch of 6 images takes seconds on the CPU: long enough to signal in the middle of it.
    sender = threading.Thread(target=lambda: in_flight.append(httpx.post(
        f"{base}/v1/detect/batch", files=[("images", (f"{i}.jpg", bus)) for i in range(6)], timeout=120)))
    sender.start()
    deadline = time.monotonic() + 30
    while metric(base, "yolopipe_queue_depth") == 0:
        assert time.monotonic() < deadline, "the batch never showed up in the queue"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    sender.join(120)
    assert proc.wait(90) == 0, log.read_text()[-3000:]
    assert len(in_flight) == 1 and in_flight[0].status_code == 200, log.read_text()[-3000:]
    assert [r.get("width") for r in in_flight[0].json()["results"]] == [810] * 6
    text = log.read_text()
    assert "Traceback" not in text and text.rstrip().endswith("stopped")
    assert not run_folder.exists()


def test_two_inference_workers_both_get_work(artifacts_dir, assets_dir, tmp_path):
    log = tmp_path / "server.log"
    # No standbys: warming beside the two workers on a small CPU, they skew each one's measured rate.
    base, proc = start_server(artifacts_dir, log, YOLOPIPE_WORKERS="1", YOLOPIPE_CPU_WORKERS="2",
                              YOLOPIPE_STANDBY="false")
    try:
        assert len(set(inference_pids(base))) == 2
        bus = (assets_dir / "bus.jpg").read_bytes()
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(f"{base}/v1/detect", content=bus, headers=JPEG, timeout=120).status_code)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 8
        per_worker = [metric(base, f'yolopipe_images_total{{outcome="ok",worker="{w}"}}') for w in ("0", "1")]
        assert sum(per_worker) == 8 and min(per_worker) >= 2, per_worker
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)


def test_the_run_folder_of_a_killed_server_is_removed_when_the_next_one_starts(artifacts_dir, tmp_path):
    """SIGKILL (of the supervisor and every child) leaves no chance to clean up: the next ``serve``
    removes the folder, whose lock no process holds any more."""
    log = tmp_path / "server.log"
    _, proc = start_server(artifacts_dir, log, YOLOPIPE_WORKERS="1", YOLOPIPE_STANDBY="false")
    try:
        run_folder = Path(re.search(r"run folder (\S+)", log.read_text()).group(1))
        assert (run_folder / "alive.lock").is_file()
        everyone = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in everyone:
            p.kill()
        psutil.wait_procs(everyone, timeout=30)
    finally:
        stop(proc)
    # The next server: one whose model cannot open is enough (it creates its run folder, then exits).
    # It says so, unless a server another test started meanwhile removed the folder first.
    nxt = subprocess.run([*CLI, "serve", "--backend", "onnxruntime", "--weights", str(tmp_path / "missing.pt"),
                          "--host", "127.0.0.1", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert not run_folder.exists(), nxt.stderr[-3000:]
