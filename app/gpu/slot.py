"""A batch slot: everything one batch in flight owns while it is decoded, uploaded, run and read.

The pipeline keeps a few slots (``RunShape.in_flight``); a ``run`` takes a free one and
gives it back once the batch's results are on the host. So with three runs in flight, batch
N+1 is decoded and uploaded into its slot while batch N's graph runs and batch N−1's rows are
unpacked from theirs, and no buffer is ever written while the GPU may still read it.

Per slot: pinned + device staging, the NMS (its request parameters live in device memory the
graph reads), pinned results, the captured graphs of each bucket (their addresses are this
slot's), three events (``uploaded`` on the copy stream, ``decoded`` on the decoder's stream,
``done`` on the compute stream) and the prepared driver calls (``RawDispatch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from app.contracts import DetectParams
from app.gpu.memory import CapturedGraphs, HostResults, Staging, release_device_memory
from app.types import ModelMeta


class BatchSlot:
    def __init__(
        self, index: int, *, max_batch: int, max_det: int, meta: ModelMeta, device: int, staging_bytes: int
    ) -> None:
        import torch

        from app.gpu.nms import GpuNms

        self.index = index
        self.device = device
        self.max_batch = max_batch
        self.staging = new_staging(max_batch, staging_bytes, device)
        self.nms = GpuNms(max_batch, meta.num_classes, meta.num_anchors, max_det=max_det)
        self.results = HostResults(max_batch, max_det)
        self.graphs = CapturedGraphs()
        self.nms_params_key: tuple | None = None
        self.dispatch: Any = None  # app.gpu.driver.RawDispatch, or None: the torch path
        # Events exist (and have a driver handle) only once recorded: record each once now.
        self.uploaded, self.decoded, self.done = (torch.cuda.Event() for _ in range(3))
        stream = torch.cuda.current_stream(device)
        for ev in (self.uploaded, self.decoded, self.done):
            ev.record(stream)
        stream.synchronize()

    def set_nms_params(self, params: DetectParams, stream: Any, context: Callable[[], Any] = contextlib.nullcontext
                       ) -> None:
        """The request's NMS parameters into this slot's device params, on ``stream`` (Numba's) inside
        ``context()`` (the device's Numba context); they persist, so rewritten only on change."""
        key = (params.conf, params.iou, params.max_det, params.classes, params.agnostic)
        if key != self.nms_params_key:
            with context():
                self.nms.set_params(conf=params.conf, iou=params.iou, max_det=params.max_det,
                                    classes=params.classes, agnostic=params.agnostic, stream=stream)
            self.nms_params_key = key

    def unpack(self, placed: Sequence[tuple], results: list[Any]) -> None:
        """Rows per image, once ``done`` has fired: batch position ``j``'s rows and letterbox into
        ``results`` at ``placed[j]``'s result index."""
        counts, rows = self.results.counts, self.results.rows
        for j, (i, lb, _, _) in enumerate(placed):
            results[i] = (rows[j, : int(counts[j])].copy(), lb)

    def handles(self) -> dict[str, int]:
        """Raw ``CUevent`` handles for the driver path."""
        return {"uploaded": int(self.uploaded.cuda_event), "done": int(self.done.cuda_event)}

    def grow(self, needed: int) -> None:
        """Bigger staging: new addresses, so this slot's graphs and driver calls are dropped."""
        self.resize_staging(max(needed, 2 * self.staging.capacity))

    def resize_staging(self, capacity: int) -> None:
        """Staging of ``capacity`` bytes: new addresses, so this slot's graphs and driver calls
        are dropped (captured again on their next use)."""
        self.graphs.free()
        self.dispatch = None
        self.staging.free()
        self.staging = new_staging(self.max_batch, capacity, self.device)

    def has(self, capacity: int, keys: Sequence[int | tuple[str, int]]) -> bool:
        """Whether its staging holds ``capacity`` bytes and it has the graphs of ``keys``."""
        return self.staging.capacity >= capacity and all(self.graphs.get(key) is not None for key in keys)

    def make_room(self, capacity: int) -> list[int | tuple[str, int]]:
        """Staging of at least ``capacity`` bytes; the keys of the graphs that growing it dropped
        (to capture again: a new address; its driver calls are to attach again)."""
        if self.staging.capacity >= capacity:
            return []
        dropped = list(self.graphs.by_batch)
        self.resize_staging(capacity)
        return dropped

    def free(self) -> None:
        with contextlib.suppress(Exception):
            self.done.synchronize()
        self.dispatch = None
        self.graphs.free()
        self.nms.free()
        self.results.free()
        self.staging.free()


def shrink_staging(slots: Sequence[BatchSlot], capacity: int, device: int, attach: Callable[[BatchSlot], Any]
                   ) -> None:
    """Staging grown past ``capacity`` (for large images) back to it, with no batch in flight:
    the grown slots' graphs and staging freed and given back to the driver with torch's cached
    device blocks and pinned host blocks (``release_device_memory``), then each given new staging
    of ``capacity`` bytes and ``attach``ed again (its graphs are captured again on their next use)."""
    import torch

    grown = [slot for slot in slots if slot.staging.capacity > capacity]
    torch.cuda.synchronize(device)
    for slot in grown:  # freed before the release: a new buffer must not split a freed one
        slot.graphs.free()
        slot.staging.free()
    release_device_memory()
    for slot in grown:
        slot.resize_staging(capacity)
        attach(slot)


def new_staging(max_batch: int, capacity: int, device: int) -> Staging:
    import torch

    staging = Staging(max_batch, capacity, device)
    # A graph is captured (and warmed up) with whatever params the header holds: zeros mean
    # "empty slot", so a capture before the first batch never reads outside the buffer.
    staging.host_params[:] = 0
    staging.dev[: staging.header_bytes].zero_()
    torch.cuda.synchronize(device)
    return staging
