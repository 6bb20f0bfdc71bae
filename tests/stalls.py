"""How long this process went without running a thread of its own. A loaded machine (CI's two
cores shared by two test workers, a CPU quota's throttling, a long garbage collection) can hold
a stream read at its source rate back for longer than its buffer covers, and such a stream then
drops its oldest frames by design. Tests of pacing ask for no drop unless a stall that long was
seen: ``StallWatch`` sees it, from a thread that sleeps a few milliseconds at a time and keeps
the longest it overslept."""

from __future__ import annotations

import threading
import time
from typing import Self


class StallWatch:
    """``with StallWatch() as watch: ...``; then ``watch.longest_s``: the longest time a sleep
    of ``tick_s`` overran while the block ran (the GIL and a core both count)."""

    def __init__(self, tick_s: float = 0.005) -> None:
        self.tick_s = tick_s
        self.longest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            time.sleep(self.tick_s)
            self.longest_s = max(self.longest_s, time.monotonic() - t0 - self.tick_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
