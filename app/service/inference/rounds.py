"""Which queued images form the batcher's next batch (``app.service.inference.batcher``).

A batch holds images that may share one detector run: equal detection parameters and one model
input size (``Detector.input_size``: the imgsz square, or under a rect letterbox the smallest
multiple of the stride holding the image), together a job's ``group``. Images wait in one queue
per request; a batch takes one image of its group from each request in turn, the request served
going to the back of the round, so a big batch request never holds single images back by more
than one batch. The group is that of the first request in the round (the one served longest
ago): the oldest work sets it, and no size waits behind others for good. A request's images
share its parameters, not always a size (a batch request of photos taken both ways): a round
takes a request's first image of the group, wherever it waits in its queue.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

_NONE_YET = object()


def take_round_robin(requests: OrderedDict[Hashable, deque[Any]], max_batch: int, now: float
                     ) -> tuple[list[Any], list[Any]]:
    """Up to ``max_batch`` jobs of one ``group``, one per request in turn, and the jobs found past
    their request's ``ref.deadline`` on the way (a request's jobs share it). ``requests`` is
    changed in place: taken and expired jobs leave their queues, emptied queues leave it."""
    batch: list[Any] = []
    expired: list[Any] = []
    group: Any = _NONE_YET
    progress = True
    while progress and len(batch) < max_batch:
        progress = False
        for key in list(requests):
            queue = requests[key]
            while queue and queue[0].ref.deadline < now:
                expired.append(queue.popleft())
            if queue and group is _NONE_YET:
                group = queue[0].group
            at = next((i for i, job in enumerate(queue) if job.group == group), None) if queue else None
            if at is not None:
                batch.append(queue[at])
                del queue[at]
                progress = True
                requests.move_to_end(key)  # served: to the back of the round
            if not queue:
                del requests[key]
            if len(batch) == max_batch:
                break
    return batch, expired
