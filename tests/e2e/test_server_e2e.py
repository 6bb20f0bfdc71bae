"""A real ``yolopipe serve`` (uvicorn) on loopback with the CPU backend and the sample model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

CLI = [sys.executable, "-m", "app.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"server not ready in {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "YOLOPIPE_ARTIFACTS_DIR": str(artifacts_dir), "YOLO_OFFLINE": "1",
           "YOLOPIPE_MAX_WAIT_MS": "5"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*CLI, "serve", "--backend", "onnxruntime", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, log)
        yield base, proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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


def test_concurrent_clients_all_succeed(server, assets_dir):
    base, _, _ = server
    images = [(assets_dir / n).read_bytes() for n in ("bus.jpg", "zidane.jpg")]
    results: list[httpx.Response] = []

    def client(i: int) -> None:
        results.append(httpx.post(f"{base}/v1/detect", content=images[i % 2],
                                  headers={"content-type": "image/jpeg"}, timeout=120))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 6
    metrics = httpx.get(f"{base}/metrics").text
    assert 'yolopipe_requests_total{path="/v1/detect",status="200"}' in metrics


def test_oversized_body_is_refused_before_it_is_read(server):
    base, _, _ = server
    huge = b"\xff\xd8\xff" + b"\x00" * (21 * 1024 * 1024)
    try:
        r = httpx.post(f"{base}/v1/detect", content=huge, headers={"content-type": "image/jpeg"}, timeout=60)
    except httpx.WriteError:  # the server may close before the client finishes sending: also a refusal
        return
    assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large"


def test_sigterm_finishes_in_flight_work_and_exits_cleanly(server, assets_dir):
    """Last in this module: it stops the server."""
    base, proc, log = server
    bus = (assets_dir / "bus.jpg").read_bytes()
    in_flight: list[httpx.Response] = []
    # A batch of 6 images takes a few seconds on the CPU: long enough to signal in the middle of it.
    sender = threading.Thread(target=lambda: in_flight.append(httpx.post(
        f"{base}/v1/detect/batch", files=[("images", (f"{i}.jpg", bus)) for i in range(6)], timeout=120)))
    sender.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        depth = [line for line in httpx.get(f"{base}/metrics").text.splitlines()
                 if line.startswith("yolopipe_queue_depth ")]
        if depth and float(depth[0].split()[1]) > 0:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the batch never showed up in the queue")
    proc.send_signal(signal.SIGTERM)
    sender.join(120)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    assert len(in_flight) == 1 and in_flight[0].status_code == 200, log.read_text()[-3000:]
    assert [r.get("width") for r in in_flight[0].json()["results"]] == [810] * 6
    text = log.read_text()
    assert "Traceback" not in text and "stopped" in text
