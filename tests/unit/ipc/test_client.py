"""The HTTP worker's client against an inference worker peer that speaks the real wire
protocol over a real Unix socket and shared-memory ring, and drops its link on cue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.config import Settings
from app.contracts import DetectParams
from app.errors import DeviceError
from app.ipc import wire
from app.ipc.answers import results
from app.ipc.client import InferenceClient
from app.ipc.layout import RunLayout
from app.ipc.ring import map_ring


class Peer(asyncio.Protocol):
    """One connection of the scripted inference worker. ``script``: what each connection does
    in turn — "hello-then-close" (the link drops right after the handshake), "close-on-image"
    (mid-request), "answer" (reads the image from the ring and answers with its length)."""

    def __init__(self, script: list[str], seen: list[bytes]) -> None:
        self.action = script.pop(0) if len(script) > 1 else script[0]
        self.seen = seen
        self.reader = wire.FrameReader()
        self.ring = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for kind, body in self.reader.feed(data):
            if kind == wire.HELLO:
                self.ring = map_ring(Path(wire.read_hello(body)["ring"]))
                self.transport.write(wire.hello({"class_names": ["a"], "generation": 0}))
                if self.action == "hello-then-close":
                    self.transport.close()
            elif kind == wire.IMAGE:
                ref = wire.read_image(body)
                if self.action == "close-on-image":
                    self.transport.close()
                    return
                self.seen.append(bytes(self.ring[ref.offset : ref.offset + ref.length]))
                self.transport.write(results([wire.Outcome(ref.req_id, ref.index, width=ref.length, height=1)]))


@pytest.fixture()
def layout():
    layout = RunLayout.create(1)
    status = wire.StatusBlock(layout.status(0), writable=True)
    status.write(wire.Load(0, wire.READY, 0, 0.001, 1))
    yield layout
    status.close()
    layout.remove()


async def _until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def test_a_link_dropping_at_its_handshake_or_mid_request_fails_fast_and_reconnects(layout):
    async def main() -> None:
        script, seen = ["hello-then-close", "close-on-image", "answer"], []
        server = await asyncio.get_running_loop().create_unix_server(lambda: Peer(script, seen),
                                                                     str(layout.socket(0)))
        client = InferenceClient(Settings(request_timeout_s=5.0), layout)
        try:
            await client.start(wait_s=0.0)
            await _until(lambda: client.ready)  # the second link: the first dropped after its hello
            with pytest.raises(DeviceError, match="stopped while this request ran"):
                await asyncio.wait_for(client.detect([b"first"], DetectParams()), 5.0)
            await _until(lambda: client.ready)  # and re-made again
            (outcome,) = await asyncio.wait_for(client.detect([b"second!"], DetectParams()), 5.0)
            assert outcome.error is None and outcome.width == len(b"second!") and seen == [b"second!"]
            assert not any(p.name.startswith("ring-") for p in layout.root.iterdir())  # no ring left behind
        finally:
            await client.close()
            server.close()

    asyncio.run(main())
