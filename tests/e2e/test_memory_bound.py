"""The worst case of README "Memory", driven: a real ``yolopipe serve`` on loopback (the CPU
model) with small limits, held at every limit at once (as many requests in flight as allowed,
each with a body at the body limit of images at the pixel limit, batches at the batch limit,
the ring full), never holds more above its resting RSS than the README's bound for those
limits; one request more is refused; and once it is over the tree goes back to rest."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import cv2
import httpx
import numpy as np
import pytest

from tests.net import RssSampler, exchange, free_port, http_request, metric_sum, multipart, tree_rss, wait_ready

MiB = 2**20
LIMITS = {  # small limits, so that the test reaches every one of them quickly
    "YOLOPIPE_MAX_BODY_BYTES": 2 * MiB,
    "YOLOPIPE_MAX_REQUESTS_IN_FLIGHT": 6,
    "YOLOPIPE_MAX_PIXELS": 1_000_000,
    "YOLOPIPE_MAX_BATCH": 4,
    "YOLOPIPE_RING_MB": 16,  # room for every request's window of images at once
    "YOLOPIPE_WORKERS": 1,
    "YOLOPIPE_STANDBY": "false",
    "YOLOPIPE_QUEUE_BUDGET_S": 3000,  # held, not refused for time (the work itself is small)
    "YOLOPIPE_REQUEST_TIMEOUT_S": 3000,
}
IMGSZ = 640
PER_PROCESS = 64 * MiB  # README: what a burst's interpreter and allocator use beyond the named owners


def bound(arena: int, images_per_request: int, *, http_workers: int = 1, inference_workers: int = 1) -> dict:
    """README "Memory", term by term, for LIMITS."""
    body, in_flight = LIMITS["YOLOPIPE_MAX_BODY_BYTES"], LIMITS["YOLOPIPE_MAX_REQUESTS_IN_FLIGHT"]
    ring = max(LIMITS["YOLOPIPE_RING_MB"] * MiB, 2 * body)
    batch, pixels = LIMITS["YOLOPIPE_MAX_BATCH"], LIMITS["YOLOPIPE_MAX_PIXELS"]
    return {
        "bodies": http_workers * 2 * in_flight * body,
        "answers": http_workers * in_flight * images_per_request * 300 * 150,
        "rings": 2 * http_workers * inference_workers * ring,  # mapped by both sides
        "batch": inference_workers * batch * (3 * pixels + 15 * IMGSZ * IMGSZ),
        "arena": inference_workers * arena,
        "processes": (http_workers + inference_workers) * PER_PROCESS,
    }


_ARENA = """
import sys
import numpy as np
from app.backends.onnxruntime import OnnxRuntimeBackend
from app.service.memory import resident_bytes
model, batch, imgsz, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
backend = OnnxRuntimeBackend(model, threads=threads or None)
x = np.zeros((batch, 3, imgsz, imgsz), np.float32)
backend.infer(x[:1])
rest, peak = resident_bytes(), 0
for n in (batch, 1, 3, 2, batch):
    backend.infer(x[:n])
    peak = max(peak, resident_bytes())
print(peak - rest)
"""


def arena_at_batch_limit(model_dir) -> int:
    """ONNX Runtime's arena on this model after batches of every size up to the limit (the
    README's "measured" term), measured in a fresh process with the server's thread count: in
    this one, heap that earlier tests freed hides part of it."""
    threads = os.environ.get("YOLOPIPE_ORT_THREADS", "0")
    out = subprocess.run([sys.executable, "-c", _ARENA, str(model_dir / "model.onnx"), str(LIMITS["YOLOPIPE_MAX_BATCH"]),
                          str(IMGSZ), threads], capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.split()[-1])


def image_at_the_pixel_limit() -> bytes:
    """A 1000×1000 JPEG (1,000,000 pixels) of noise: ~0.9 MB, so that two fill a body."""
    img = np.random.default_rng(0).integers(0, 256, (1000, 1000, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()


def answered(url: str) -> float:
    """Images the inference workers answered so far."""
    return metric_sum(httpx.get(f"{url}/metrics", timeout=10).text, "yolopipe_images_total")


def queued(url: str) -> int:
    """Images waiting at the inference workers now."""
    workers = httpx.get(f"{url}/v1/model", timeout=10).json()["serving"]["inference_workers"]
    return sum(w["queued_images"] for w in workers)


def admitted(url: str, answered_before: float) -> float:
    """Images admitted since ``answered_before`` was read: answered since, plus queued now (read
    in that order, so that an image moving between the two is missed, never counted twice)."""
    return answered(url) - answered_before + queued(url)


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    """``yolopipe serve`` (the CPU model) at LIMITS, in a session of its own; gRPC on a free port."""
    port, log = free_port(), tmp_path_factory.mktemp("bound") / "server.log"
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLOPIPE_GRPC_PORT": str(free_port()),
           **{k: str(v) for k, v in LIMITS.items()}}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--weights", "sample", "--backend",
                                 "onnxruntime", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, timeout=300)
        yield proc, port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_held_at_every_limit_the_tree_stays_under_the_readme_bound(server, sample_model_dir):
    proc, port = server
    url = f"http://127.0.0.1:{port}"
    image = image_at_the_pixel_limit()
    per_request = (LIMITS["YOLOPIPE_MAX_BODY_BYTES"] - 4096) // (len(image) + 200)
    body, ctype = multipart("images", [image] * per_request)
    assert 0.8 * LIMITS["YOLOPIPE_MAX_BODY_BYTES"] < len(body) <= LIMITS["YOLOPIPE_MAX_BODY_BYTES"]
    for _ in range(3):  # warm-up
        httpx.post(f"{url}/v1/detect", content=image, headers={"content-type": "image/jpeg"}, timeout=60)
    time.sleep(4)  # the idle release after the warm-up
    rest = tree_rss(proc.pid)
    request = http_request("/v1/detect/batch", body, ctype, "127.0.0.1")
    # The one more sends its head only: refused before its body is read, its answer cannot be
    # lost to a reset of a connection still being written to (admitted, it would wait for a body).
    head_only = request[: request.index(b"\r\n\r\n") + 4]
    in_flight = LIMITS["YOLOPIPE_MAX_REQUESTS_IN_FLIGHT"]
    answered_before = answered(url)

    async def drive() -> list[int | None]:
        held = [asyncio.ensure_future(exchange("127.0.0.1", port, request, 600))
                for _ in range(in_flight)]
        # All in: every held request's images admitted (queued or answered); served a batch at a
        # time, one image of each request in turn, so none is over yet.
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(admitted, url, answered_before) < in_flight * per_request:
            assert time.monotonic() < deadline and not any(h.done() for h in held), "the held requests never got in"
            await asyncio.sleep(0.02)
        one_more = await exchange("127.0.0.1", port, head_only, 60)
        return [one_more, *await asyncio.gather(*held)]

    with RssSampler(proc.pid, period=0.1) as sampler:
        one_more, *held = asyncio.run(drive())
    terms = bound(arena_at_batch_limit(sample_model_dir), per_request)
    grew = sampler.peak - rest
    report = (f"rest {rest / MiB:.0f} MiB, peak {sampler.peak / MiB:.0f} MiB (+{grew / MiB:.0f}); bound "
              f"{sum(terms.values()) / MiB:.0f} MiB: " + ", ".join(f"{k} {v / MiB:.0f}" for k, v in terms.items()))
    print(report)
    assert one_more == 503 and held == [200] * in_flight, (one_more, held)
    assert grew <= sum(terms.values()), report
    assert grew >= 0.25 * sum(terms.values()), "the drive did not come near the limits: " + report
    # A deadline for a hung release, not a target (how soon: bench/memory_probe.py's figure).
    start = time.monotonic()
    while tree_rss(proc.pid) > 1.1 * rest and time.monotonic() - start < 90:
        time.sleep(0.25)
    print(f"back within 10 % of rest {time.monotonic() - start:.1f} s after the last answer")
    settled = tree_rss(proc.pid)
    assert settled <= 1.1 * rest, f"{settled / MiB:.0f} MiB 90 s after the last answer; " + report
