"""Admission as an HTTP client sees it: the app with its own inference worker process (CPU
backend, sample model). The batching itself is tested in tests/unit/serving/test_batcher.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from app.service.http_worker import create_service_app
from app.settings import Settings

JPEG = {"content-type": "image/jpeg"}


@asynccontextmanager
async def serving(artifacts_dir, **settings) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running (which starts its inference worker), and a client."""
    app = create_service_app(Settings(backend="onnxruntime", artifacts_dir=artifacts_dir, **settings))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            yield client


async def timed_post(client: httpx.AsyncClient, url: str, **kwargs) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = await client.post(url, **kwargs)
    return r, time.perf_counter() - t0


def test_work_over_the_time_budget_gets_503_with_retry_after_at_once(artifacts_dir, bus):
    async def main() -> list[tuple[httpx.Response, float]]:
        # A budget below one image's time: only an empty queue admits.
        async with serving(artifacts_dir, queue_budget_s=0.001) as client:
            return await asyncio.gather(*(timed_post(client, "/v1/detect", content=bus, headers=JPEG)
                                          for _ in range(6)))

    answers = asyncio.run(main())
    served = [t for r, t in answers if r.status_code == 200]
    refused = [(r, t) for r, t in answers if r.status_code == 503]
    assert served and refused and len(served) + len(refused) == 6, [r.status_code for r, _ in answers]
    for r, seconds in refused:
        assert r.json()["error"]["code"] == "overloaded" and "budget" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        assert seconds < min(served) / 2  # refused at once, not after waiting


def metric(text: str, prefix: str) -> float:
    """The sum of a ``/metrics`` page's samples whose line starts with ``prefix``."""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def test_one_request_keeps_at_most_its_window_of_images_at_the_worker(artifacts_dir, bus):
    async def main() -> tuple[httpx.Response, str, str]:
        # A budget no CPU misses (this is about the window, not admission: a loaded machine's
        # warm-up may measure seconds per image).
        async with serving(artifacts_dir, request_window=2, max_wait_ms=50, queue_budget_s=600) as client:
            before = (await client.get("/metrics")).text
            files = [("images", (f"{i}.jpg", bus, "image/jpeg")) for i in range(5)]
            r = await client.post("/v1/detect/batch", files=files)
            return r, before, (await client.get("/metrics")).text

    r, before, after = asyncio.run(main())
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 5

    def ran(prefix: str) -> float:  # batches (or images) the request ran in, from the batch size histogram
        return metric(after, prefix) - metric(before, prefix)

    # Without the window they would run in batches of the CPU's max_batch (4), over the window.
    assert ran("yolopipe_batch_size_sum") == 5
    assert ran('yolopipe_batch_size_bucket{le="2.0"}') == ran("yolopipe_batch_size_count") >= 3


def test_pixel_limit_is_checked_on_the_header_before_any_work(artifacts_dir, bus):
    async def main() -> tuple[httpx.Response, str]:
        async with serving(artifacts_dir, max_pixels=1000) as client:
            r = await client.post("/v1/detect", content=bus, headers=JPEG)
            return r, (await client.get("/metrics")).text

    r, metrics = asyncio.run(main())
    assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large"
    assert "874,800 pixels" in r.json()["error"]["message"]
    assert "yolopipe_images_total" not in metrics  # no image reached the inference worker


def test_a_batch_whose_whole_cost_is_over_the_budget_is_refused_at_once_and_never_queued(artifacts_dir, bus):
    """A budget below eight images' time on this CPU: a batch of eight is refused whole, at once,
    on /v1 and /v2 alike, and no image of it reaches the inference worker; one image is served."""
    import base64

    async def main() -> tuple[list[tuple[httpx.Response, float]], httpx.Response, str, str]:
        async with serving(artifacts_dir, queue_budget_s=0.05) as client:
            files = [("images", (f"{i}.jpg", bus, "image/jpeg")) for i in range(8)]
            v2 = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [8],
                              "data": [base64.b64encode(bus).decode()] * 8}]}
            before = (await client.get("/metrics")).text
            refused = [await timed_post(client, "/v1/detect/batch", files=files),
                       await timed_post(client, "/v2/models/yolopipe/infer", json=v2)]
            after = (await client.get("/metrics")).text
            one = await client.post("/v1/detect", content=bus, headers=JPEG)
            return refused, one, before, after

    refused, one, before, after = asyncio.run(main())
    for r, seconds in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "8 images, behind 0 queued" in r.text and "send fewer images per request" in r.text
        assert seconds < 2.0
    images = [line for line in after.splitlines() if line.startswith("yolopipe_images_total")]
    assert images == [line for line in before.splitlines() if line.startswith("yolopipe_images_total")]
    assert one.status_code == 200
