"""Dynamic batching, backpressure, timeouts, device failures and draining, on the real detector.

Faults are injected into the real detector's pipeline (``pipeline.run`` wrapped on the
instance): a gate that holds the worker inside a batch, or one raised exception.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager

import httpx
import pytest

from app.api.main import create_app
from app.config import Settings
from app.runtime import open_detector

JPEG = {"content-type": "image/jpeg"}


@pytest.fixture(scope="module")
def detector(artifacts_dir):
    with open_detector("sample", backend="onnxruntime", artifacts_dir=artifacts_dir) as det:
        yield det


@pytest.fixture(scope="module")
def bus(assets_dir) -> bytes:
    return (assets_dir / "bus.jpg").read_bytes()


@asynccontextmanager
async def serving(detector, artifacts_dir, **settings) -> AsyncIterator[tuple[httpx.AsyncClient, object]]:
    """The app with its lifespan running, and an async client talking to it in-process."""
    app = create_app(Settings(backend="onnxruntime", artifacts_dir=artifacts_dir, **settings), detector=detector)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            yield client, app


@contextmanager
def gated(detector):
    """Hold every ``pipeline.run`` until the gate opens; ``entered`` counts calls that started."""
    gate = threading.Event()
    entered = []
    real_run = detector.pipeline.run

    def run(images, params):
        entered.append(len(images))
        gate.wait(30)
        return real_run(images, params)

    detector.pipeline.run = run
    try:
        yield gate, entered
    finally:
        gate.set()
        del detector.pipeline.run  # back to the class's method


@contextmanager
def failing_once(detector, exc: Exception):
    real_run = detector.pipeline.run
    calls = []

    def run(images, params):
        calls.append(len(images))
        if len(calls) == 1:
            raise exc
        return real_run(images, params)

    detector.pipeline.run = run
    try:
        yield calls
    finally:
        del detector.pipeline.run


async def until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def metric(text: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def test_full_queue_answers_503_with_retry_after_at_once(detector, artifacts_dir, bus):
    async def scenario():
        async with serving(detector, artifacts_dir, max_queue=2, max_batch=1) as (client, app):
            batcher = app.state.batcher
            with gated(detector) as (gate, entered):
                held = [asyncio.create_task(client.post("/v1/detect", content=bus, headers=JPEG)) for _ in range(2)]
                await until(lambda: batcher.queued == 2 and entered)
                t0 = time.perf_counter()
                refused = await client.post("/v1/detect", content=bus, headers=JPEG)
                refused_s = time.perf_counter() - t0
                gate.set()
                done = await asyncio.gather(*held)
            metrics = (await client.get("/metrics")).text
        return refused, refused_s, done, metrics

    refused, refused_s, done, metrics = asyncio.run(scenario())
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    assert refused_s < 1.0  # refused at once, not after waiting for room
    assert [r.status_code for r in done] == [200, 200]
    assert metric(metrics, 'yolopipe_rejected_total{reason="queue_full"}') == 1
    assert "yolopipe_queue_depth 0.0" in metrics


def test_request_timeout_gives_504_and_frees_its_place(detector, artifacts_dir, bus):
    async def scenario():
        async with serving(detector, artifacts_dir, request_timeout_s=0.5) as (client, app):
            with gated(detector) as (gate, _):
                late = await client.post("/v1/detect", content=bus, headers=JPEG)
                gate.set()
            await until(lambda: app.state.batcher.queued == 0)
            app.state.batcher.request_timeout_s = 60  # a CPU inference alone may take 0.5 s on a busy machine
            after = await client.post("/v1/detect", content=bus, headers=JPEG)
        return late, after

    late, after = asyncio.run(scenario())
    assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
    assert after.status_code == 200 and after.json()["detections"]


def test_device_failure_fails_that_batch_with_503_and_keeps_serving(detector, artifacts_dir, bus):
    async def scenario():
        async with serving(detector, artifacts_dir) as (client, _):
            with failing_once(detector, RuntimeError("CUDA error: out of memory")) as calls:
                failed = await client.post("/v1/detect", content=bus, headers=JPEG)
                ok = await client.post("/v1/detect", content=bus, headers=JPEG)
            with failing_once(detector, RuntimeError("CUDA error: out of memory")):
                batch_failed = await client.post(
                    "/v1/detect/batch", files=[("images", ("a.jpg", bus)), ("images", ("b.jpg", bus))]
                )
            metrics = (await client.get("/metrics")).text
        return failed, ok, batch_failed, calls, metrics

    failed, ok, batch_failed, calls, metrics = asyncio.run(scenario())
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "device_error"
    assert "Traceback" not in failed.text and failed.headers["retry-after"] == "1"
    assert ok.status_code == 200 and ok.json()["detections"]
    assert calls == [1, 1]
    assert batch_failed.status_code == 503 and batch_failed.json()["error"]["code"] == "device_error"
    assert metric(metrics, "yolopipe_device_errors_total") == 2


def test_waiting_requests_coalesce_by_parameters(detector, artifacts_dir, bus):
    async def scenario():
        async with serving(detector, artifacts_dir, max_batch=16) as (client, app):
            batcher = app.state.batcher
            with gated(detector) as (gate, entered):
                first = asyncio.create_task(client.post("/v1/detect", content=bus, headers=JPEG))
                await until(lambda: entered == [1])
                same = [asyncio.create_task(client.post("/v1/detect", content=bus, headers=JPEG)) for _ in range(4)]
                other = [asyncio.create_task(client.post("/v1/detect?conf=0.5", content=bus, headers=JPEG))
                         for _ in range(2)]
                await until(lambda: len(batcher._queue) == 6)
                gate.set()
                results = await asyncio.gather(first, *same, *other)
            return results, list(entered)

    results, entered = asyncio.run(scenario())
    assert all(r.status_code == 200 for r in results)
    # the queued requests ran as two batches, one per parameter set (which one first depends on
    # which decode finished first)
    assert entered[0] == 1 and sorted(entered[1:]) == [2, 4]
    assert [r.json()["timings"]["batch_size"] for r in results] == [1, 4, 4, 4, 4, 2, 2]
    (expected,) = detector.detect([bus], detector.params(conf=0.5))
    assert results[-1].json()["detections"] == expected.to_json("image", detector.names)["detections"]


def test_shutdown_finishes_queued_work_and_refuses_new(detector, artifacts_dir, bus):
    async def scenario():
        async with serving(detector, artifacts_dir) as (client, app):
            batcher = app.state.batcher
            with gated(detector) as (gate, entered):
                held = [asyncio.create_task(client.post("/v1/detect", content=bus, headers=JPEG)) for _ in range(3)]
                await until(lambda: batcher.queued == 3 and entered)
                closing = asyncio.create_task(batcher.close())
                await until(lambda: batcher.closing)
                refused = await client.post("/v1/detect", content=bus, headers=JPEG)
                ready = await client.get("/readyz")
                gate.set()
                done = await asyncio.gather(*held)
                await closing
        return refused, ready, done

    refused, ready, done = asyncio.run(scenario())
    assert [r.status_code for r in done] == [200, 200, 200]
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert ready.status_code == 503


def test_pixel_limit_from_settings(artifacts_dir, bus):
    async def scenario():
        app = create_app(Settings(backend="onnxruntime", artifacts_dir=artifacts_dir, max_pixels=500_000))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.post("/v1/detect", content=bus, headers=JPEG)

    r = asyncio.run(scenario())  # bus.jpg is 810 x 1080 = 874,800 pixels
    assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large"
