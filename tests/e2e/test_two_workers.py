"""Two inference workers behind one ``yolopipe serve`` (CPU backend): they share the load, and
each image goes to the worker with less work queued.

The counts per worker are the service's own (``yolopipe_images_total{worker=...}`` in /metrics,
the queue from /v1/model's ``inference_workers``), read from a real server; the workers are
real processes, one of them frozen (SIGSTOP) to hold its queue still.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.net import free_port, wait_ready

JPEG = {"content-type": "image/jpeg"}


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    """One HTTP worker (one router, so its view of the queues is the whole view), two inference workers."""
    log = tmp_path_factory.mktemp("two-workers") / "server.log"
    port = free_port()
    env = {**os.environ, "YOLOPIPE_ARTIFACTS_DIR": str(artifacts_dir), "YOLO_OFFLINE": "1", "YOLOPIPE_MAX_WAIT_MS": "5",
           "YOLOPIPE_ORT_THREADS": "1"}  # the two workers get the same CPU share
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--backend", "onnxruntime", "--cpu-workers",
                                 "2", "--workers", "1", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, log, ready=both_workers_ready)
        yield base
    finally:
        for pid in worker_pids(base, quiet=True):  # never leave a stopped worker behind
            with_signal(pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def both_workers_ready(base: str) -> bool:
    serving = httpx.get(f"{base}/v1/model", timeout=2).json().get("serving", {})
    return len(serving.get("inference_workers", [])) == 2 and all(w["ready"] for w in serving["inference_workers"])


def workers(base: str) -> list[dict]:
    return httpx.get(f"{base}/v1/model", timeout=30).json()["serving"]["inference_workers"]


def worker_pids(base: str, *, quiet: bool = False) -> list[int]:
    try:
        return [w["pid"] for w in workers(base)]
    except httpx.HTTPError:
        if quiet:
            return []
        raise


def with_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def answered(base: str) -> list[float]:
    """Images each inference worker has answered, from /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    counts = [0.0, 0.0]
    for line in text.splitlines():
        for w in (0, 1):
            if line.startswith("yolopipe_images_total{") and f'worker="{w}"' in line:
                counts[w] += float(line.split()[-1])
    return counts


def detect(base: str, image: bytes, timeout: float = 300) -> dict:
    r = httpx.post(f"{base}/v1/detect", content=image, headers=JPEG, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def boxes(body: dict) -> list:
    return [(d["class_id"], d["score"], d["box"]) for d in body["detections"]]


def test_concurrent_requests_are_shared_evenly(server, assets_dir):
    bus = (assets_dir / "bus.jpg").read_bytes()
    before = answered(server)
    with ThreadPoolExecutor(6) as pool:
        bodies = list(pool.map(lambda _: detect(server, bus), range(24)))
    after = answered(server)
    per_worker = [a - b for a, b in zip(after, before)]
    assert sum(per_worker) == 24, per_worker
    # Each worker takes the next image when it has the shorter queue, so with equal workers
    # neither is left idle while the other queues: at most a few images apart, not all on one.
    assert min(per_worker) >= 8, per_worker
    # and whichever worker answered, the answer is the same
    assert all(boxes(b) == boxes(bodies[0]) for b in bodies)


def test_an_image_goes_to_the_worker_with_less_queued(server, assets_dir):
    """Worker 0 frozen with work queued: every later request is answered, so by worker 1."""
    bus = (assets_dir / "bus.jpg").read_bytes()
    frozen = None
    with ThreadPoolExecutor(12) as pool:
        for _attempt in range(5):
            load = [pool.submit(detect, server, bus) for _ in range(12)]  # both workers get a share
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not workers(server)[0]["queued_images"]:
                time.sleep(0.02)
            pid = workers(server)[0]["pid"]
            with_signal(pid, signal.SIGSTOP)
            if workers(server)[0]["queued_images"]:  # stopped while its status shows work queued
                frozen = pid
                break
            with_signal(pid, signal.SIGCONT)  # it finished just before the stop: again
            for f in load:
                f.result()
        assert frozen is not None, "worker 0 never showed queued work"
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and workers(server)[1]["queued_images"]:
                time.sleep(0.02)  # worker 1 answers its share of the load: now it has less queued
            before = answered(server)
            # one at a time, each waiting for its answer: one sent to the frozen worker never comes back
            later = [detect(server, bus, timeout=60) for _ in range(4)]
            after = answered(server)
        finally:
            with_signal(frozen, signal.SIGCONT)
        for f in load:  # the frozen worker's share is answered once it runs again
            assert boxes(f.result()) == boxes(later[0])
    assert after[1] - before[1] == 4 and after[0] == before[0], (before, after)
