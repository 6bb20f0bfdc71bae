"""/metrics reads a file per serving process: requests must be served while it does."""

from __future__ import annotations

import asyncio
import errno
import os
import struct
import threading

import httpx

from app.api.main import create_app
from app.ipc.client import InferenceClient
from app.ipc.layout import RunLayout
from app.settings import Settings


def test_healthz_is_served_while_metrics_wait_on_a_process_file():
    layout = RunLayout.create(0)
    app = create_app(Settings(), InferenceClient(Settings(), layout))
    # A metrics file that blocks its reader until we let go (a FIFO): a slow disk, a stalled mount.
    fifo = layout.metrics_dir / "counter_4242.db"
    os.mkfifo(fifo)
    reader_blocked, healthz_done = threading.Event(), threading.Event()
    answered_while_blocked: list[bool] = []

    def hold_the_reader() -> None:
        while True:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # succeeds once a reader opened it
                break
            except OSError as exc:
                assert exc.errno == errno.ENXIO
        reader_blocked.set()
        answered_while_blocked.append(healthz_done.wait(10.0))
        os.write(fd, struct.pack("<ii", 8, 0))  # an empty metrics file
        os.close(fd)

    async def main() -> tuple[int, int]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                scrape = asyncio.create_task(client.get("/metrics"))
                while not reader_blocked.is_set():
                    await asyncio.sleep(0.01)
                health = await client.get("/healthz")
                healthz_done.set()
                return health.status_code, (await scrape).status_code

    holder = threading.Thread(target=hold_the_reader, daemon=True)
    holder.start()
    try:
        statuses = asyncio.run(main())
    finally:
        healthz_done.set()
        holder.join(15.0)
        layout.remove()
    assert answered_while_blocked == [True]
    assert statuses == (200, 200)
