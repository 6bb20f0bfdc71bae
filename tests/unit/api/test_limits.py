"""What one HTTP worker holds is bounded: at most ``max_requests_in_flight`` requests with a
body at once (one more is answered 503 before its body is read), and a refused or failed
request leaves nothing behind (once answered, no object still holds its body: nothing waits
in a reference cycle for a full collection). Driven through the whole app, in front of an
inference worker peer that speaks the real wire protocol."""

from __future__ import annotations

import asyncio
import gc
import io

import httpx
import pytest

from app.api.main import create_app
from app.ipc import wire
from app.ipc.client import InferenceClient
from app.ipc.layout import RunLayout
from app.settings import Settings
from tests.worker_peer import Peer, ready_worker_layout

PADDING = 7_777  # trailing bytes after the JPEG's end: a body length nothing else in the process has


def holders_of_length(n: int) -> list[str]:
    """The types of the objects that hold a bytes object of exactly ``n`` bytes."""
    return [type(o).__name__ for o in gc.get_objects()
            for r in gc.get_referents(o) if type(r) is bytes and len(r) == n]


@pytest.fixture()
def layout():
    with ready_worker_layout() as layout:
        yield layout


def run_app(settings: Settings, layout: RunLayout, action: str, body) -> object:
    """``body(client, app)`` against the app with its inference worker peer; its result."""
    app = create_app(settings, InferenceClient(settings, layout))

    async def main():
        server = await asyncio.get_running_loop().create_unix_server(lambda: Peer([action], []),
                                                                     str(layout.socket(0)))
        try:
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as client:
                    while app.state.inference.info is None:
                        await asyncio.sleep(0.01)
                    return await body(client, app)
        finally:
            server.close()

    return asyncio.run(main())


@pytest.mark.parametrize("case, status", [("refused-here", 503), ("refused-by-the-worker", 503), ("timed-out", 504)])
@pytest.mark.parametrize("form", ["raw", "multipart", "batch"])
def test_a_failed_request_leaves_no_body_behind(layout, assets_dir, case, status, form):
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

    async def body(client, app):
        if case == "refused-here":  # the status block: the worker is over its budget
            wire.StatusBlock(layout.status(0), writable=True).write(wire.Load(0, wire.READY, 50, 1.0, 1))
        gc.disable()
        try:
            answered = await send(client)
            await asyncio.sleep(0.05)  # the worker's late answers, if any
            return answered, holders_of_length(length)
        finally:
            gc.enable()

    settings = Settings(request_timeout_s=0.3, queue_budget_s=1.0)
    answered, holders = run_app(settings, layout, "overloaded" if case == "refused-by-the-worker" else "silent", body)
    assert answered == status
    assert holders == [], f"the body is still held by {holders}"


def test_one_request_over_the_in_flight_limit_is_refused_before_its_body_is_read(layout, assets_dir):
    """Four requests wait on a worker that never answers: a fifth with a body gets 503 (its
    body unread: the connection closes); probes still answer; once the four time out, a
    request is taken again."""
    jpeg = (assets_dir / "bus.jpg").read_bytes()
    chunks_read: list[int] = []

    async def body(client, app):
        def post(tag: int):
            async def pieces():
                yield jpeg[:1000]
                chunks_read.append(tag)
                yield jpeg[1000:]

            return client.post("/v1/detect", content=pieces(), headers={"content-type": "image/jpeg"})

        waiting = [asyncio.ensure_future(post(i)) for i in range(4)]
        while len(chunks_read) < 4:  # all four are in, their bodies read
            await asyncio.sleep(0.01)
        extra = await post(4)
        probes = [(await client.get(path)).status_code for path in ("/healthz", "/readyz", "/metrics")]
        held = [r.status_code for r in await asyncio.gather(*waiting)]
        again = await client.post("/v1/detect", content=jpeg, headers={"content-type": "image/jpeg"})
        return extra, probes, held, again.status_code

    settings = Settings(request_timeout_s=1.0, max_requests_in_flight=4)
    extra, probes, held, again = run_app(settings, layout, "silent", body)
    assert extra.status_code == 503 and extra.json()["error"]["code"] == "overloaded", extra.text
    assert extra.headers["connection"] == "close" and "retry-after" in extra.headers
    assert 4 not in chunks_read  # refused before the body's second piece was asked for
    assert probes == [200, 200, 200]
    assert held == [504] * 4 and again == 504  # the slot is free again (and the silent worker times it out)
