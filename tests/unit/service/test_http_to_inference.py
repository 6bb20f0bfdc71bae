"""An HTTP worker's app and an inference worker's serving loop in this process (the CPU model
behind a pipeline that decodes JPEGs itself, as the GPU's does), joined by their real socket and
ring: what travels from a request to the decoder, and what the service reports of its run."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
from dataclasses import replace

import httpx
import pytest

from app.api.main import create_app
from app.config import CPU_MAX_BATCH
from app.contracts import EncodedImage
from app.imaging.check import check_image
from app.ipc.client import InferenceClient
from app.ipc.layout import RunLayout
from app.ipc.wire import StatusBlock
from app.pipeline.detector import Detector
from app.service.inference.worker import WorkerSpec, _serve
from app.settings import Settings
from tests.standins import DecodesItself, count_header_reads


class Reports(list):
    send = list.append


@pytest.fixture()
def service(cpu_detector):
    """``(settings, pipeline, run)``: ``run(requests)`` serves while ``requests(http)`` runs."""
    layout = RunLayout.create(1)
    StatusBlock(layout.status(0), writable=True).close()  # as the pool does: readers open it at once
    settings = Settings(backend="onnxruntime", max_batch=32, max_wait_ms=1, request_timeout_s=60.0)
    pipeline = DecodesItself(cpu_detector.pipeline)
    # The run shape app.runtime opens the CPU model with when asked for 32: clamped to its 16.
    detector = Detector(pipeline, replace(cpu_detector.shape, max_wait_ms=settings.max_wait_ms))

    def run(requests):
        async def main():
            serving = asyncio.create_task(_serve(WorkerSpec(0, None, layout, 0, os.getpid()), settings, detector,
                                                 Reports()))
            app = create_app(settings, InferenceClient(settings, layout))
            try:
                async with app.router.lifespan_context(app):
                    client = app.state.inference
                    for _ in range(1200):
                        if client.ready and client.info is not None:
                            break
                        await asyncio.sleep(0.1)
                    transport = httpx.ASGITransport(app=app)
                    async with httpx.AsyncClient(transport=transport, base_url="http://yolopipe", timeout=120) as http:
                        return await requests(http)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # the worker's own way out: drain, close, return
                await asyncio.wait_for(serving, 60)

        return asyncio.run(main())

    try:
        yield settings, pipeline, run
    finally:
        layout.remove()


def test_each_header_is_read_once_from_v1_and_v2_to_the_decoder(service, bus, zidane, monkeypatch):
    """The HTTP worker reads each image's header (checking it); the bytes go on with it through
    the wire and the batcher to the decoder (``EncodedImage``): no header is read again."""
    settings, pipeline, run = service
    sent = [bus, bus, zidane, zidane, bus]
    reads: list[int] = []

    async def requests(http):
        pipeline.received.clear()  # the warm-up's gray frames
        pipeline.bytes_seen.clear()
        spy = count_header_reads(monkeypatch)
        one = await http.post("/v1/detect", content=bus, headers={"content-type": "image/jpeg"})
        two = await http.post("/v1/detect/batch", files=[("images", ("b.jpg", bus)), ("images", ("z.jpg", zidane))])
        v2 = await http.post("/v2/models/yolopipe/infer", json={"inputs": [{
            "name": "image", "datatype": "BYTES", "shape": [2],
            "data": [base64.b64encode(d).decode() for d in (zidane, bus)]}]})
        reads.extend(spy)
        return one, two, v2

    one, two, v2 = run(requests)
    assert (one.status_code, two.status_code, v2.status_code) == (200, 200, 200), (one.text, two.text, v2.text)
    assert len(one.json()["detections"]) > 0 and len(v2.json()["outputs"]) == 4
    assert sorted(reads) == sorted(len(d) for d in sent)  # the HTTP worker's one read of each
    assert all(isinstance(x, EncodedImage) for x in pipeline.received) and len(pipeline.received) == len(sent)
    seen = zip(pipeline.received, pipeline.bytes_seen)  # each JPEG's bytes as its run found them
    assert sorted((len(data), x.header == check_image(data)) for x, data in seen) == sorted((len(d), True) for d in sent)


def test_the_service_reports_one_max_batch_the_run_shapes(service):
    """Asked for 32, the CPU model runs batches of ``CPU_MAX_BATCH`` (``RunShape``, clamped where
    it is opened): ``/v1/model`` says so wherever it names the batch, and a request keeps as many
    images in flight."""
    settings, _, run = service

    async def requests(http):
        return (await http.get("/v1/model")).json()

    model = run(requests)
    assert settings.max_batch == 32
    assert CPU_MAX_BATCH < 32
    assert model["max_batch"] == model["serving"]["max_batch"] == model["serving"]["request_window"] == CPU_MAX_BATCH
