"""Memory a burst took goes back once it is over (every serving process).

A process that served a burst keeps what the burst made it allocate: Python's cyclic garbage
waits for the next full collection (rare in a process with a large heap of imports), glibc
keeps freed heap in its arenas (one per thread that allocated), ONNX Runtime keeps its arena
at the largest batch it ran, and torch keeps freed GPU blocks (and pinned host blocks) cached.
``IdleRelease`` gives all of it back once the process has been quiet for ``after_s`` seconds:
nothing in flight, nothing begun meanwhile. Under steady load it never runs, so it costs no
throughput; after a burst it runs once. bench/results/2026-12-01-cpu-memory-bursts.md has the
measurements that chose it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from app.heap import trim_heap

log = logging.getLogger("yolopipe.serving")


_WORTH_LOGGING = 16 * 2**20  # a release that gave back less is logged at debug level


def resident_bytes() -> int:
    """This process's resident set (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_memory(pipeline_release: Callable[[], None] | None = None) -> None:
    """A full collection (cyclic garbage frees its memory), the pipeline's own release, then
    glibc's ``malloc_trim(0)``: the free pages of every arena go back to the kernel."""
    gc.collect()
    if pipeline_release is not None:
        pipeline_release()
    trim_heap()


class IdleRelease:
    """Calls ``release`` (on a thread) once the process has been quiet for ``after_s`` seconds
    after some activity: ``touch()`` marks activity (from any thread), or ``activity()``, a
    count read every tick, moved; ``busy()`` says whether work is in flight now. ``after_s``
    0: never."""

    def __init__(self, after_s: float, release: Callable[[], None], busy: Callable[[], bool],
                 activity: Callable[[], int] | None = None) -> None:
        self.after_s = after_s
        self._release = release
        self._busy = busy
        self._activity = activity
        self._seen = activity() if activity is not None else 0
        self._last = time.monotonic()
        self._dirty = False
        self._task: asyncio.Task | None = None
        self.releases = 0  # how many times it ran (for tests and logs)

    def touch(self) -> None:
        self._last = time.monotonic()
        self._dirty = True

    def start(self) -> None:
        """Watch from the running event loop (once; later calls do nothing)."""
        if self._task is None and self.after_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="yolopipe-idle-release")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        while True:
            if self._activity is not None:  # polled: a quarter of the quiet spell at a time
                wait = self.after_s / 4
            else:
                wait = max(self.after_s - (time.monotonic() - self._last), self.after_s / 4)
            await asyncio.sleep(wait)
            if self._activity is not None and (seen := self._activity()) != self._seen:
                self._seen = seen
                self.touch()
            if not self._dirty or self._busy() or time.monotonic() - self._last < self.after_s:
                continue
            self._dirty = False  # activity from here on asks for another release
            before = resident_bytes()
            try:
                await asyncio.to_thread(self._release)
            except Exception as exc:  # noqa: BLE001 (memory not given back is no reason to stop serving)
                log.warning("could not give memory back after a burst: %s", exc, exc_info=exc)
            self.releases += 1
            after = resident_bytes()
            log.log(logging.INFO if before - after >= _WORTH_LOGGING else logging.DEBUG,
                    "quiet for %g s: gave back %.0f MB (resident %.0f -> %.0f MB)", self.after_s,
                    (before - after) / 2**20, before / 2**20, after / 2**20)


class ActivityMiddleware:
    """Pure ASGI: each HTTP request marks ``idle`` active, and it counts as busy while any runs."""

    def __init__(self, app: Any, idle: IdleRelease) -> None:
        self.app = app
        self.idle = idle
        self.in_flight = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.idle.start()
        self.idle.touch()
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.idle.touch()
