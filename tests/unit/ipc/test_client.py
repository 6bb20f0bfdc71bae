"""The HTTP worker's client against an inference worker peer that speaks the real wire
protocol over a real Unix socket and shared-memory ring, and drops its link on cue."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from app.config import Settings
from app.contracts import DetectParams
from app.errors import DeviceError, Overloaded, RequestTimeout
from app.ipc import wire
from app.ipc.client import InferenceClient
from app.ipc.layout import RunLayout
from tests.worker_peer import Peer


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


class Bodies(list):
    """A request's image list that can be watched (a plain list takes no weak reference)."""


@pytest.mark.parametrize("case", ["refused-here", "refused-by-the-worker", "timed-out", "link-lost"])
def test_a_failed_request_frees_its_bodies_at_once(layout, case):
    """Whatever fails a request (refused before sending, refused by the worker, its deadline, a
    lost link), its image bytes are freed by reference counting as soon as the caller is done
    with the error, even while the worker still holds some of its images: nothing is left in a
    reference cycle for a later full collection. A burst of refused requests would otherwise
    hold every refused body."""
    action = {"refused-by-the-worker": "overloaded", "link-lost": "close-on-image"}.get(case, "silent")

    async def main() -> None:
        server = await asyncio.get_running_loop().create_unix_server(lambda: Peer([action], []),
                                                                     str(layout.socket(0)))
        client = InferenceClient(Settings(request_timeout_s=0.3, queue_budget_s=1.0), layout)
        try:
            await client.start(wait_s=0.0)
            await _until(lambda: client.ready)
            if case == "refused-here":  # the status block says the worker is over its budget
                wire.StatusBlock(layout.status(0), writable=True).write(wire.Load(0, wire.READY, 50, 1.0, 1))
            bodies = Bodies([b"x" * 1000, b"y" * 1000])
            watch = weakref.ref(bodies)
            expected = {"refused-here": Overloaded, "refused-by-the-worker": Overloaded,
                        "timed-out": RequestTimeout, "link-lost": DeviceError}[case]
            gc.disable()
            try:
                with pytest.raises(expected):
                    await client.detect(bodies, DetectParams())
                del bodies
                assert watch() is None, [type(r).__name__ for r in gc.get_referrers(watch())]
            finally:
                gc.enable()
            await _until(lambda: client.ready)  # (after a lost link: re-made, not closed mid-handshake)
        finally:
            await client.close()
            server.close()

    asyncio.run(main())
