"""The inference worker's serving loop in this process (the CPU model), reached by a real
client over its Unix socket and ring, with a fault injected into the real pipeline."""

from __future__ import annotations

import asyncio
import os

import pytest

from app.errors import DeviceError
from app.ipc.client import InferenceClient
from app.ipc.layout import RunLayout
from app.ipc.wire import StatusBlock
from app.service.inference.worker import WorkerSpec, _serve
from app.settings import Settings


class Reports(list):
    send = list.append


def test_a_lost_device_context_drains_the_worker_and_ends_it_not_ready(cpu_detector, bus):
    layout = RunLayout.create(1)
    StatusBlock(layout.status(0), writable=True).close()  # as the pool does: readers open it at once
    settings = Settings(backend="onnxruntime", max_wait_ms=1, request_timeout_s=10.0)
    detector = cpu_detector

    def dead_context(images, params, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def main() -> str | None:
        reports = Reports()
        serving = asyncio.create_task(_serve(WorkerSpec(0, None, layout, 0, os.getpid()), settings, detector, reports))
        client = InferenceClient(settings, layout)
        try:
            await client.start(wait_s=120.0)
            assert client.ready and reports[0][0] == "ready"
            answers = await client.detect([bus], detector.params())
            assert len(answers.detected) == 1 and answers.detected.errors == {}
            assert answers.detected.counts[0] > 0  # bus.jpg: people and a bus
            detector.pipeline.run = dead_context
            with pytest.raises(DeviceError):
                await client.detect([bus], detector.params())
            reason = await asyncio.wait_for(serving, 30.0)  # drained and returned: the process exits for a restart
            assert not client.ready
            return reason
        finally:
            await client.close()
            if not serving.done():
                serving.cancel()

    try:
        reason = asyncio.run(main())
    finally:
        detector.pipeline.__dict__.pop("run", None)
        layout.remove()
    assert reason is not None and "illegal memory access" in reason
