"""The HTTP worker's client against an inference worker peer that speaks the real wire
protocol over a real Unix socket and shared-memory ring, and drops its link on cue."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from app.contracts import DetectParams
from app.errors import DeviceError, Overloaded, RequestTimeout
from app.ipc import wire
from app.ipc.client import InferenceClient
from app.settings import Settings
from tests.worker_peer import Peer, ready_worker_layout


@pytest.fixture()
def layout():
    with ready_worker_layout() as layout:
        yield layout


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
            answered = await asyncio.wait_for(client.detect([b"second!"], DetectParams()), 5.0)
            assert not answered.detected.errors and answered.detected.widths.tolist() == [len(b"second!")]
            assert seen == [b"second!"]
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


def test_a_request_is_judged_whole_and_refused_before_any_image_is_sent(layout):
    """At 0.2 s an image on one lane and a 30 s budget: 256 images (51 s) are refused at once and
    none reaches the worker; 100 (20 s) are served; behind 60 images another HTTP worker queued,
    100 more (32 s) are refused; a single image is taken by an idle worker however slow it is."""
    status = wire.StatusBlock(layout.status(0), writable=True)

    async def main() -> None:
        seen: list[bytes] = []
        server = await asyncio.get_running_loop().create_unix_server(lambda: Peer(["answer"], seen),
                                                                     str(layout.socket(0)))
        client = InferenceClient(Settings(request_timeout_s=30.0, request_window=4), layout)
        try:
            await client.start(wait_s=0.0)
            await _until(lambda: client.ready)
            status.write(wire.Load(0, wire.READY, 0, 0.2, 1))
            with pytest.raises(Overloaded, match="256 images, behind 0 queued, would take about 51.2 s, over the 30 s"):
                await client.detect([b"x"] * 256, DetectParams())
            assert seen == [] and client._unsent == 0
            answered = await asyncio.wait_for(client.detect([b"y"] * 100, DetectParams()), 10.0)
            assert len(seen) == 100 and len(answered.detected) == 100 and not answered.detected.errors
            assert client._unsent == 0
            status.write(wire.Load(0, wire.READY, 60, 0.2, 1))
            with pytest.raises(Overloaded, match="behind 60 queued"):
                await client.detect([b"z"] * 100, DetectParams())
            status.write(wire.Load(0, wire.READY, 0, 100.0, 1))
            answered = await asyncio.wait_for(client.detect([b"one"], DetectParams()), 10.0)
            assert len(answered.detected) == 1 and not answered.detected.errors and len(seen) == 101
            with pytest.raises(Overloaded):  # two are over the budget even on an idle worker
                await client.detect([b"two"] * 2, DetectParams())
        finally:
            await client.close()
            server.close()

    asyncio.run(main())


def test_images_an_http_worker_has_yet_to_send_count_for_the_next_request(layout):
    """A request of 100 images keeps 4 at the worker (its window); the other 96 are queued work
    all the same: a second request that would finish behind them past the budget is refused."""
    status = wire.StatusBlock(layout.status(0), writable=True)

    async def main() -> None:
        release = asyncio.Event()

        class SlowPeer(Peer):
            def data_received(self, data: bytes) -> None:  # answers only once released
                asyncio.get_running_loop().create_task(self._later(data))

            async def _later(self, data: bytes) -> None:
                await release.wait()
                Peer.data_received(self, data)

        seen: list[bytes] = []
        server = await asyncio.get_running_loop().create_unix_server(lambda: SlowPeer(["answer"], seen),
                                                                     str(layout.socket(0)))
        client = InferenceClient(Settings(request_timeout_s=30.0, request_window=4), layout)
        try:
            await client.start(wait_s=0.0)
            release.set()
            await _until(lambda: client.ready)
            release.clear()
            status.write(wire.Load(0, wire.READY, 0, 0.2, 1))
            first = asyncio.ensure_future(client.detect([b"a"] * 100, DetectParams()))
            await _until(lambda: client._unsent == 96)
            with pytest.raises(Overloaded, match="60 images, behind 100 queued"):
                await client.detect([b"b"] * 60, DetectParams())
            release.set()
            assert len((await asyncio.wait_for(first, 10.0)).detected) == 100 and client._unsent == 0
        finally:
            await client.close()
            server.close()

    asyncio.run(main())


def test_calls_time_out_each_at_its_own_deadline_and_answered_ones_are_forgotten(layout):
    """One timer serves every call's deadline: calls begun at different times on a worker that
    never answers each time out about ``request_timeout_s`` (plus the grace) after its own start,
    in order; a call answered before its deadline leaves nothing behind to time out, and no
    timer is left once no call waits."""
    from app.ipc.client import _GRACE_S

    timeout = 0.2

    async def main() -> None:
        loop = asyncio.get_running_loop()
        silent = await loop.create_unix_server(lambda: Peer(["silent"], []), str(layout.socket(0)))
        client = InferenceClient(Settings(request_timeout_s=timeout, queue_budget_s=10.0), layout)
        try:
            await client.start(wait_s=0.0)
            await _until(lambda: client.ready)

            async def timed(delay: float) -> float:
                await asyncio.sleep(delay)
                begun = loop.time()
                with pytest.raises(RequestTimeout, match="no result within 0.2 s"):
                    await client.detect([b"x"], DetectParams())
                return loop.time() - begun

            async with asyncio.timeout(10.0):
                waits = await asyncio.gather(*(timed(d) for d in (0.0, 0.15, 0.3, 0.45)))
            for waited in waits:  # each after its own deadline, none long after it
                assert timeout + _GRACE_S <= waited + 0.01 < timeout + _GRACE_S + 1.0, waits
            assert not client._expiring and client._expiry_timer is None
        finally:
            await client.close()
            silent.close()
            await silent.wait_closed()
        answering = await loop.create_unix_server(lambda: Peer(["answer"], []), str(layout.socket(0)))
        client = InferenceClient(Settings(request_timeout_s=timeout, queue_budget_s=10.0), layout)
        try:
            await client.start(wait_s=0.0)
            await _until(lambda: client.ready)
            bodies = Bodies([b"answered"])
            watch = weakref.ref(bodies)
            answered = await client.detect(bodies, DetectParams())
            assert answered.detected.widths.tolist() == [len(b"answered")]
            del bodies, answered
            assert watch() is None  # nothing waits to time the answered call out
            assert not client._expiring
            await asyncio.sleep(timeout + _GRACE_S + 0.1)  # its timer fires, finds nothing overdue
            assert client._expiry_timer is None
        finally:
            await client.close()
            answering.close()

    asyncio.run(main())


def test_a_lost_worker_is_not_reported_by_its_old_pid(layout):
    """/v1/model's pid is that of the worker this HTTP worker is connected to; once the link is
    lost (the worker killed) the dead worker's pid is not reported while the link is re-made."""
    import os

    async def main() -> None:
        server = await asyncio.get_running_loop().create_unix_server(lambda: Peer(["close-on-image"], []),
                                                                     str(layout.socket(0)))
        client = InferenceClient(Settings(request_timeout_s=5.0), layout)
        try:
            await client.start(wait_s=0.0)
            await _until(lambda: client.ready)
            assert client.workers()[0]["pid"] == os.getpid()  # the peer's hello
            server.close()  # no new connection from here on
            with pytest.raises(DeviceError):
                await client.detect([b"x"], DetectParams())  # the peer drops the link on it
            assert client.workers()[0]["pid"] is None
        finally:
            await client.close()

    asyncio.run(main())
