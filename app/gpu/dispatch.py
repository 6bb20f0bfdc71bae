"""Upload and launch one batch, and wait for it: the host's whole part in the GPU work.

Per batch: the H2D copy of ``[header | frames]`` on the copy stream and the ``uploaded``
event; the compute stream waits for that (and for the decoder's ``decoded`` event when the
batch holds GPU-decoded JPEGs), replays the bucket's graph and records ``done``. Through the
CUDA driver (``app.gpu.driver.RawDispatch``: a handful of ctypes calls, a few microseconds)
when it can, else through torch (``Tensor.copy_``, ``Stream.wait_event``, ``CUDAGraph.replay``).

When no other batch is in flight (latency: one request at a time) the upload goes straight
on the compute stream instead, which saves the cross-stream wait: on the H200 host a graph
launch behind a wait for a copy still in flight cost a few hundred microseconds more.

Reported per batch: ``upload_us`` (enqueueing the H2D copy), ``dispatch_us`` (the waits, the
graph launch and the ``done`` record), ``launch_us`` (the graph launch and the record alone)
and ``upload_on_compute`` (1 when the batch was alone in flight).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time

from app.errors import DeviceError
from app.gpu.capture import STAGES
from app.gpu.memory import CapturedBatch, StreamPair
from app.gpu.slot import BatchSlot
from app.gpu.timeline import BatchMarks

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, device: int, compute: StreamPair, copy_stream, *, raw_launch: bool) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.compute = compute
        self.copy_stream = copy_stream
        self._driver = None
        self._context: int | None = None
        self._lock = threading.Lock()
        self._active = 0  # batches submitted and not yet waited for
        self._thread = threading.local()
        self.raw_launch_error: str | None = None if raw_launch else "disabled (raw_launch=False)"

    # --------------------------------------------------------------------------- set-up
    def setup(self, slots: list[BatchSlot]) -> None:
        """The driver path for every slot, or the reason it is off. Never raises: torch's path
        always works."""
        if self.raw_launch_error is not None:
            return
        try:
            from app.gpu.driver import cuda_driver

            self._driver = cuda_driver()
            self._context = self._driver.primary_context(self.device)
            if not hasattr(self._torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
                raise DeviceError("this torch has no CUDAGraph.raw_cuda_graph_exec")
            for slot in slots:
                self.attach(slot)
        except Exception as exc:  # noqa: BLE001 - an optimisation, never a requirement
            self.raw_launch_error = f"{type(exc).__name__}: {exc}"
            log.warning("GPU pipeline: raw CUDA driver dispatch off (%s); using torch", self.raw_launch_error)
            for slot in slots:
                slot.dispatch = None
            self.close()

    def attach(self, slot: BatchSlot) -> None:
        """(Re)build the slot's driver calls for its current staging buffers (no-op when off)."""
        slot.dispatch = None
        if self._driver is None or self._context is None:
            return
        from app.gpu.driver import RawDispatch

        try:
            slot.dispatch = RawDispatch(
                self._driver, self._context, copy_stream=self.copy_stream.cuda_stream,
                compute_stream=self.compute.torch.cuda_stream, dst=slot.staging.dev.data_ptr(),
                src=slot.staging.host.data_ptr(), **slot.handles(),
            )
        except Exception as exc:  # noqa: BLE001 - this slot goes on through torch
            log.warning("GPU pipeline: driver dispatch off on slot %d (%s)", slot.index, exc)

    def close(self) -> None:
        if self._driver is not None and self._context is not None:
            with contextlib.suppress(Exception):
                self._driver.release_primary_context(self.device)
        self._context = None

    # ------------------------------------------------------------------------------ run
    def submit(self, slot: BatchSlot, captured: CapturedBatch, host_end: int, waits_decoder: bool,
               marks: BatchMarks | None, timings: dict[str, float]) -> str:
        """Enqueue the upload and the graph; returns the path taken (``driver`` | ``torch``).
        Every ``submit`` is followed by one ``wait`` of the same slot."""
        with self._lock:
            alone = self._active == 0  # nothing else in flight: the upload goes on the compute stream
            self._active += 1
        try:
            if slot.dispatch is not None and captured.graph_exec is not None:
                try:
                    self._submit_raw(slot, captured, host_end, waits_decoder, alone, marks, timings)
                    return "driver"
                except DeviceError as exc:
                    # This slot goes back to torch for good and the batch is enqueued again that way:
                    # re-uploading the same bytes is harmless, a failed launch ran nothing, and a
                    # real device fault fails there too, as a DeviceError.
                    log.warning("GPU pipeline: driver dispatch failed on slot %d (%s); using torch", slot.index, exc)
                    slot.dispatch = None
            self._submit_torch(slot, captured, host_end, waits_decoder, alone, marks, timings)
            return "torch"
        except BaseException:
            self._finished()
            raise

    def _submit_raw(self, slot, captured, host_end, waits_decoder, alone, marks, timings) -> None:
        raw = slot.dispatch
        up_stream = self.compute.torch if alone else self.copy_stream
        t0 = time.perf_counter()
        if not getattr(self._thread, "current", False):  # once per thread: the driver API needs a context
            raw.make_current()
            self._thread.current = True
        if marks is not None:
            marks.record("upload", False, up_stream)
        raw.upload(host_end, on_compute=alone)
        if marks is not None:
            marks.record("upload", True, up_stream)
        t1 = time.perf_counter()
        raw.wait_inputs(not alone, int(slot.decoded.cuda_event) if waits_decoder else None)
        if marks is not None:
            marks.record("compute", False, self.compute.torch)
        t2 = time.perf_counter()
        raw.launch(captured.graph_exec)
        raw.record_done()
        t3 = time.perf_counter()
        if marks is not None:
            marks.record("compute", True, self.compute.torch)
        timings.update(upload_us=(t1 - t0) * 1e6, dispatch_us=(t3 - t1) * 1e6, launch_us=(t3 - t2) * 1e6,
                       upload_on_compute=float(alone))

    def _submit_torch(self, slot, captured, host_end, waits_decoder, alone, marks, timings) -> None:
        torch, staging, compute = self._torch, slot.staging, self.compute.torch
        up_stream = compute if alone else self.copy_stream
        t0 = time.perf_counter()
        with torch.cuda.stream(up_stream):
            if marks is not None:
                marks.record("upload", False, up_stream)
            staging.dev[:host_end].copy_(staging.host[:host_end], non_blocking=True)
            if not alone:
                slot.uploaded.record(up_stream)
            if marks is not None:
                marks.record("upload", True, up_stream)
        t1 = time.perf_counter()
        if not alone:
            compute.wait_event(slot.uploaded)
        if waits_decoder:
            compute.wait_event(slot.decoded)
        with torch.cuda.stream(compute):
            if marks is not None:
                marks.record("compute", False, compute)
            t2 = time.perf_counter()
            captured.graph.replay()  # replays on the current stream: the compute stream
            slot.done.record(compute)
            t3 = time.perf_counter()
            if marks is not None:
                marks.record("compute", True, compute)
        timings.update(upload_us=(t1 - t0) * 1e6, dispatch_us=(t3 - t1) * 1e6, launch_us=(t3 - t2) * 1e6,
                       upload_on_compute=float(alone))

    def wait(self, slot: BatchSlot, path: str) -> None:
        """Block until the slot's batch is done; the GIL is released meanwhile."""
        try:
            if path == "driver" and slot.dispatch is not None:
                slot.dispatch.wait()
            else:
                slot.done.synchronize()
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._lock:
            self._active -= 1

    def profiled(self, slot: BatchSlot, captured: CapturedBatch, host_end: int, waits_decoder: bool) -> dict[str, float]:
        """The same work as one launch, stage by stage with CUDA events between the stages (syncs)."""
        torch, stream, staging = self._torch, self.compute.torch, slot.staging
        ev = {name: torch.cuda.Event(enable_timing=True) for name in ("h2d", *STAGES, "end")}
        t0 = time.perf_counter()
        if waits_decoder:
            stream.wait_event(slot.decoded)
        with torch.cuda.stream(stream):
            ev["h2d"].record(stream)
            staging.dev[:host_end].copy_(staging.host[:host_end], non_blocking=True)
            for name in STAGES:
                ev[name].record(stream)
                captured.stage_graphs[name].replay()
            ev["end"].record(stream)
            slot.done.record(stream)
        t1 = time.perf_counter()
        stream.synchronize()
        out = {"dispatch_us": (t1 - t0) * 1e6}
        for a, b in itertools.pairwise(["h2d", *STAGES, "end"]):
            out[f"gpu_{a}_ms"] = ev[a].elapsed_time(ev[b])
        out["gpu_total_ms"] = ev["h2d"].elapsed_time(ev["end"])
        return out
