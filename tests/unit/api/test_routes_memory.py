"""A refused or failed request leaves nothing behind: once its answer is sent, no object still
holds its body (nothing in a reference cycle that waits for a full collection). Driven through
the whole app, in front of an inference worker peer that speaks the real wire protocol."""

from __future__ import annotations

import asyncio
import gc
import io

import httpx
import pytest

from app.api.main import create_app
from app.config import Settings
from app.errors import Overloaded
from app.ipc import wire
from app.ipc.answers import results
from app.ipc.client import InferenceClient
from app.ipc.layout import RunLayout

PADDING = 7_777  # trailing bytes after the JPEG's end: a body length nothing else in the process has


class Peer(asyncio.Protocol):
    """An inference worker that answers every image with ``Overloaded`` ("refuse") or never ("silent")."""

    def __init__(self, action: str) -> None:
        self.action = action
        self.reader = wire.FrameReader()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for kind, body in self.reader.feed(data):
            if kind == wire.HELLO:
                self.transport.write(wire.hello({"class_names": ["a", "b"], "generation": 0}))
            elif kind == wire.IMAGE and self.action == "refuse":
                ref = wire.read_image(body)
                error = Overloaded("the queue holds 99 s of work")
                self.transport.write(results([wire.Outcome(ref.req_id, ref.index, error=error)]))


def holders_of_length(n: int) -> list[str]:
    """The types of the objects that hold a bytes object of exactly ``n`` bytes."""
    return [type(o).__name__ for o in gc.get_objects()
            for r in gc.get_referents(o) if type(r) is bytes and len(r) == n]


@pytest.mark.parametrize("case, status", [("refused-here", 503), ("refused-by-the-worker", 503), ("timed-out", 504)])
@pytest.mark.parametrize("form", ["raw", "multipart", "batch"])
def test_a_failed_request_leaves_no_body_behind(assets_dir, case, status, form):
    layout = RunLayout.create(1)
    load = wire.StatusBlock(layout.status(0), writable=True)
    load.write(wire.Load(0, wire.READY, 0, 0.001, 1))
    settings = Settings(request_timeout_s=0.3, queue_budget_s=1.0)
    app = create_app(settings, InferenceClient(settings, layout))
    length = (assets_dir / "bus.jpg").stat().st_size + PADDING

    async def send(client: httpx.AsyncClient) -> int:
        # The client side holds no bytes object of the body's length (it sends pieces, or reads
        # a file), so one found afterwards is the server's.
        body = (assets_dir / "bus.jpg").read_bytes() + b"\0" * PADDING
        if form == "raw":
            async def pieces():
                yield body[:1000]
                yield body[1000:]

            r = await client.post("/v1/detect", content=pieces(), headers={"content-type": "image/jpeg"})
        elif form == "multipart":
            r = await client.post("/v1/detect", files={"image": ("bus.jpg", io.BytesIO(body), "image/jpeg")})
        else:
            r = await client.post("/v1/detect/batch", files=[("images", (f"{i}.jpg", io.BytesIO(body), "image/jpeg"))
                                                             for i in range(3)])
        return r.status_code

    async def main() -> tuple[int, list[str]]:
        action = "refuse" if case == "refused-by-the-worker" else "silent"
        server = await asyncio.get_running_loop().create_unix_server(lambda: Peer(action), str(layout.socket(0)))
        try:
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                    while app.state.inference.info is None:
                        await asyncio.sleep(0.01)
                    if case == "refused-here":  # the status block: the worker is over its budget
                        load.write(wire.Load(0, wire.READY, 50, 1.0, 1))
                    gc.disable()
                    try:
                        answered = await send(client)
                        await asyncio.sleep(0.05)  # the worker's late answers, if any
                        return answered, holders_of_length(length)
                    finally:
                        gc.enable()
        finally:
            server.close()

    try:
        answered, holders = asyncio.run(main())
    finally:
        load.close()
        layout.remove()
    assert answered == status
    assert holders == [], f"the body is still held by {holders}"
