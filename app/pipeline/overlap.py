"""Keep several batches in flight: ``fn`` on each item in worker threads, results in order.

A pipeline whose ``run`` overlaps with itself (``in_flight > 1``, the GPU pipeline) is fed
from this (``Detector.run`` for its runs, and front ends that stream many batches: folders,
videos, streams, ``Detector.run_batches``): while one call waits for its batch's graph (without the GIL), the next decodes and
uploads and the previous one's rows are turned into detections, so the engine never waits for
the host. The next item is submitted before a result is handed back, so the consumer's own
work (writing JSON, say) overlaps with the GPU too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_overlapped(fn: Callable[[T], R], items: Iterable[T], in_flight: int) -> Iterator[R]:
    """``fn(item)`` for every item, up to ``in_flight`` at once; yields the results in item order."""
    if in_flight <= 1:
        for item in items:
            yield fn(item)
        return
    it = iter(items)
    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="yolopipe-batch") as pool:
        pending: deque[Future] = deque()

        def submit_next() -> bool:
            for item in it:
                pending.append(pool.submit(fn, item))
                return True
            return False

        while len(pending) < in_flight and submit_next():
            pass
        while pending:
            result = pending.popleft().result()
            submit_next()
            yield result
