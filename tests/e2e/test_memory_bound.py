"""The worst case of README "Memory", driven: a real ``yolopipe serve`` on loopback (the CPU
model) with small limits, held at every limit at once (as many requests in flight as allowed,
each with a body at the body limit of images at the pixel limit, batches at the batch limit,
the ring full), never holds more above its resting RSS than the README's bound for those
limits; one request more is refused; and once it is over the tree goes back to rest."""

from __future__ import annotations

import asyncio
import time

import cv2
import numpy as np
import pytest

from bench import memory_probe

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


def arena_at_batch_limit(model_dir) -> int:
    """ONNX Runtime's arena on this model after batches of every size up to the limit, measured
    here (the README's "measured" term)."""
    from app.backends.onnxruntime import OnnxRuntimeBackend
    from app.service.memory import resident_bytes

    backend = OnnxRuntimeBackend(model_dir / "model.onnx")
    try:
        x = np.zeros((LIMITS["YOLOPIPE_MAX_BATCH"], 3, IMGSZ, IMGSZ), np.float32)
        backend.infer(x[:1])
        rest, peak = resident_bytes(), 0
        for n in (LIMITS["YOLOPIPE_MAX_BATCH"], 1, 3, 2, LIMITS["YOLOPIPE_MAX_BATCH"]):
            backend.infer(x[:n])
            peak = max(peak, resident_bytes())
        return peak - rest
    finally:
        backend.close()


def image_at_the_pixel_limit() -> bytes:
    """A 1000×1000 JPEG (1,000,000 pixels) of noise: ~0.9 MB, so that two fill a body."""
    img = np.random.default_rng(0).integers(0, 256, (1000, 1000, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    args = memory_probe.parse_args(["--ready-timeout-s", "300", *(f"--env={k}={v}" for k, v in LIMITS.items())])
    proc, port = memory_probe.start_server(args, tmp_path_factory.mktemp("bound") / "server.log")
    yield proc, port
    memory_probe.stop_server(proc)


def test_held_at_every_limit_the_tree_stays_under_the_readme_bound(server, sample_model_dir):
    proc, port = server
    url = f"http://127.0.0.1:{port}"
    image = image_at_the_pixel_limit()
    per_request = (LIMITS["YOLOPIPE_MAX_BODY_BYTES"] - 4096) // (len(image) + 200)
    body, ctype = memory_probe.multipart("images", [image] * per_request)
    assert 0.8 * LIMITS["YOLOPIPE_MAX_BODY_BYTES"] < len(body) <= LIMITS["YOLOPIPE_MAX_BODY_BYTES"]
    memory_probe.warm(url, image, 3)
    time.sleep(4)  # the idle release after the warm-up
    tree = memory_probe.Tree(proc.pid, url, port)
    rest = tree.rss()
    request = memory_probe.http_request("/v1/detect/batch", body, ctype, "127.0.0.1")
    in_flight = LIMITS["YOLOPIPE_MAX_REQUESTS_IN_FLIGHT"]

    async def drive() -> list[int | None]:
        held = [asyncio.ensure_future(memory_probe.exchange("127.0.0.1", port, request, 600))
                for _ in range(in_flight)]
        await asyncio.sleep(1.0)  # all in, bodies read; served a batch at a time, one image of each in turn
        one_more = await memory_probe.exchange("127.0.0.1", port, request, 60)
        return [one_more, *await asyncio.gather(*held)]

    with memory_probe.Sampler(tree, period=0.1) as sampler:
        one_more, *held = asyncio.run(drive())
    terms = bound(arena_at_batch_limit(sample_model_dir), per_request)
    grew = sampler.peak - rest
    report = (f"rest {rest / MiB:.0f} MiB, peak {sampler.peak / MiB:.0f} MiB (+{grew / MiB:.0f}); bound "
              f"{sum(terms.values()) / MiB:.0f} MiB: " + ", ".join(f"{k} {v / MiB:.0f}" for k, v in terms.items()))
    print(report)
    assert one_more == 503 and held == [200] * in_flight, (one_more, held)
    assert grew <= sum(terms.values()), report
    assert grew >= 0.25 * sum(terms.values()), "the drive did not come near the limits: " + report
    deadline = time.monotonic() + 10.0
    while tree.rss() > 1.1 * rest and time.monotonic() < deadline:
        time.sleep(0.25)
    assert tree.rss() <= 1.1 * rest, f"{tree.rss() / MiB:.0f} MiB 10 s after the last answer; " + report
