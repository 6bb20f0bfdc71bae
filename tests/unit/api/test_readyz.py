"""/readyz while the inference worker starts: not ready, and saying which warm-up step it is at
(read from the worker's status block, as the HTTP workers of ``yolopipe serve`` read it)."""

from __future__ import annotations

import asyncio

import httpx

from app.api.main import create_app
from app.ipc import wire
from app.ipc.client import InferenceClient
from app.ipc.layout import RunLayout
from app.service.inference.warmup import warmup
from app.settings import Settings


def test_readyz_names_the_warm_up_step_of_a_starting_worker():
    layout = RunLayout.create(1)
    status = wire.StatusBlock(layout.status(0), writable=True)
    status.write(wire.Load(0, wire.STARTING, 0, 0.0, 1))
    status.write_phase("warming up batch size 32 (2 of 2)")
    app = create_app(Settings(), InferenceClient(Settings(), layout))

    async def main() -> httpx.Response:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return await client.get("/readyz")

    try:
        r = asyncio.run(main())
    finally:
        status.close()
        layout.remove()
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    assert "worker 0: warming up batch size 32 (2 of 2)" in r.json()["error"]["message"]


def test_warm_up_reports_each_step(cpu_detector):
    steps: list[str] = []
    assert warmup(cpu_detector, (1, 2), steps.append) > 0
    assert steps[1:] == ["warming up batch size 1 (1 of 2)", "warming up batch size 2 (2 of 2)"]
    assert steps[0].startswith("warming up the pipeline")


def test_a_status_block_says_whether_a_warm_standby_is_ready(tmp_path):
    writer = wire.StatusBlock(tmp_path / "s", writable=True)
    reader = wire.StatusBlock(tmp_path / "s", writable=False)
    writer.write(wire.Load(3, wire.READY, 5, 0.01, 2))
    assert reader.read_standby() == 0
    writer.write_standby(4242)
    writer.write_phase("x" * 1000)
    assert reader.read_standby() == 4242 and reader.read() == wire.Load(3, wire.READY, 5, 0.01, 2)
    assert reader.read_phase() == "x" * 256
    writer.close()
    reader.close()
