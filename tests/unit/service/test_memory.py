"""Memory a burst took goes back: the idle watcher's timing, and each piece of the release on
the real thing (ONNX Runtime's arena on the sample model, glibc's heap, cyclic garbage)."""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
import pytest

from app.service.memory import IdleRelease, release_memory, resident_bytes

MB = 2**20


def test_it_releases_once_after_a_quiet_spell_never_while_busy_or_without_activity():
    async def main() -> tuple[list[float], list[float], list[float]]:
        released: list[float] = []
        busy = [False]
        idle = IdleRelease(0.2, lambda: released.append(time.monotonic()), busy=lambda: busy[0])
        idle.start()
        await asyncio.sleep(0.6)
        without_activity = list(released)  # nothing happened: nothing to give back
        for _ in range(5):  # activity every 0.1 s: never quiet for 0.2 s
            idle.touch()
            await asyncio.sleep(0.1)
        last = time.monotonic()
        during = [t for t in released if t < last]
        busy[0] = True  # no activity, but work in flight
        await asyncio.sleep(0.5)
        while_busy = list(released)
        busy[0] = False
        idle.touch()  # the work's end is activity too (as the workers mark it)
        await asyncio.sleep(0.6)
        await idle.stop()
        return without_activity, during, [t - last for t in released] + while_busy

    without_activity, during, after = asyncio.run(main())
    assert without_activity == [] and during == []
    (delay,) = after  # one release, quiet for 0.2 s after the busy spell, not during it
    assert 0.7 <= delay <= 1.1


def test_an_activity_count_that_moves_is_activity_too():
    """The gRPC worker's way: no hook per call, a count of calls read at every tick."""
    async def main() -> tuple[list[float], float]:
        released: list[float] = []
        calls = [0]
        idle = IdleRelease(0.2, lambda: released.append(time.monotonic()), busy=lambda: False,
                           activity=lambda: calls[0])
        idle.start()
        await asyncio.sleep(0.5)
        assert released == []  # the count has not moved
        for _ in range(6):  # a call every 0.1 s
            calls[0] += 1
            last = time.monotonic()
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        await idle.stop()
        return released, last

    released, last = asyncio.run(main())
    (at,) = released
    assert 0.15 <= at - last <= 0.5


def test_a_release_that_fails_is_logged_and_the_watcher_goes_on(caplog):
    calls: list[int] = []

    def release() -> None:
        calls.append(1)
        raise RuntimeError("no")

    async def main() -> None:
        idle = IdleRelease(0.05, release, busy=lambda: False)
        idle.start()
        for _ in range(2):
            idle.touch()
            await asyncio.sleep(0.3)
        await idle.stop()

    asyncio.run(main())
    assert len(calls) == 2 and "could not give memory back" in caplog.text


def test_release_frees_cyclic_garbage_and_trims_the_heap():
    gc.disable()
    try:
        for _ in range(200):  # 200 cycles of 1 MB each, as requests caught in tracebacks would be
            a: dict = {"body": bytearray(MB)}
            a["self"] = a
        del a
        held = resident_bytes()
        release_memory()
        assert held - resident_bytes() > 150 * MB
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def backend(sample_model_dir):
    from app.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend(sample_model_dir / "model.onnx", threads=2)


def test_onnxruntime_gives_its_arena_back_and_answers_the_same_after(backend):
    # The service's release: the arena's shrink, then glibc's trim. Whether freed arena regions
    # leave the resident set without the trim depends on what this test process ran before (glibc
    # raises its mmap threshold as large blocks are freed): in CI, 133 MB of 377 stayed. Without
    # the shrink the arena keeps its regions and no trim can give them back.
    x = np.random.default_rng(0).random((8, 3, 640, 640), dtype=np.float32)
    first = backend.infer(x[:1])
    release_memory(backend.release_memory)
    rest = resident_bytes()
    backend.infer(x)  # a batch of 8 grows the arena by hundreds of MB
    grown = resident_bytes()
    release_memory(backend.release_memory)
    released = resident_bytes()
    assert grown - rest > 100 * MB
    assert released - rest < 0.1 * (grown - rest), (rest / MB, grown / MB, released / MB)
    np.testing.assert_array_equal(backend.infer(x[:1]), first)  # the session works as before
