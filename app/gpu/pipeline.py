"""The GPU request path: images → boxes with one CUDA-graph launch per batch.

Per batch the host does only this:

1. decode JPEG bytes with nvJPEG (batched, default) or with OpenCV in a host thread pool
   (``jpeg_decode="cpu"``), or take decoded BGR frames;
2. pack frames into the pinned staging buffer after the per-image params header (large
   batches: in the host thread pool); JPEGs decoded on the GPU are already on the device and
   are packed there with one ``torch.cat(..., out=...)``;
3. if the request parameters changed, write them to the NMS's device params (rare);
4. **dispatch**: one H2D copy of ``[params header | frames]`` and one graph launch, two CUDA
   driver calls (``app.gpu.driver``; ``Tensor.copy_`` + ``CUDAGraph.replay()`` if the driver
   path is unavailable);
5. one stream sync, then slice each image's rows by its count.

The graph of a bucket (1, 2, 4, ... ``max_batch``; a batch is padded up to its bucket with
empty slots) holds, all on one non-default stream:

    letterbox kernel → engine.forward(input) → GpuNms.run(head) → D2H of rows + counts

The NMS reads the engine's output where the engine wrote it (``__cuda_array_interface__``,
no copy); the only device→host traffic is the final copy into pinned memory.

**Lanes.** A lane owns everything one batch in flight needs: a stream, staging (pinned +
device), the engine input, a ``GpuNms``, pinned results and its graphs (with their own
memory pool). The engine's weights are shared. ``run`` takes a free lane, so with
``lanes=2`` two threads calling ``run`` overlap the host work of one batch (decode, pack) with
the GPU work of the other. Captures (which call ``engine.forward``) run with every other lane
idle (``_Gate``), so an engine's forward is never called concurrently and a capture never
sees another thread's CUDA calls. An engine runs on several lanes only if it says how:
``engine.for_lane(i)`` returns the engine object lane ``i`` uses (``TorchCudaEngine``:
itself); without it the pipeline has one lane.

Profiling (``run(..., profile=True)``): CUDA events cannot be recorded between the nodes of
one graph, so that path replays four graphs captured per stage (preprocess, engine, NMS, D2H)
with events between them. The stages run the same kernels on the same buffers as the full
graph; only the engine's head lives in a second tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numba import cuda

from app.backends.base import DeviceEngine, PipelineInput
from app.errors import DeviceError, InvalidImage, InvalidParameter, YolopipeError
from app.gpu.memory import (
    CapturedBatch,
    CapturedGraphs,
    HostResults,
    InputBuffer,
    Staging,
    StreamPair,
    align_up,
)
from app.gpu.preprocess import (
    LAYOUT_CHW_RGB,
    LAYOUT_HWC_BGR,
    _cpu_decode,
    decode_jpegs,
    fill_params,
    launch_letterbox,
    letterbox_placement,
)
from app.types import DetectParams, Letterbox, ModelMeta

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs per bucket before capture (kernel loading, cuDNN autotune, compile)
IMAGE_ALIGN = 16  # byte alignment of each frame in the staging buffer
STAGES = ("preprocess", "engine", "nms", "d2h")
JPEG_DECODERS = ("gpu", "cpu")
PARALLEL_PACK_MIN = 16  # frames in a batch from which the pinned copies go to the host pool


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (which is always the last bucket)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


def split_even(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into at most ``parts`` contiguous, non-empty pieces of near-equal size."""
    parts = max(1, min(int(parts), n))
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        if stop > start:
            out.append(range(start, stop))
        start = stop
    return out


class _Gate:
    """Many runs at once (``shared``), or one capture with nothing else running (``exclusive``).

    A waiting exclusive holder goes before new shared ones, so a capture is not starved by a
    steady stream of batches. A shared holder that needs a capture releases its share first
    (``exclusive`` is not an upgrade), so two of them can never wait for each other.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if self._shared == 0:
                self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self):
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    @contextlib.contextmanager
    def exclusive(self):
        self.acquire_exclusive()
        try:
            yield
        finally:
            self.release_exclusive()


class _Lane:
    """One batch in flight: its stream, buffers, NMS, results and graphs (see the module doc)."""

    def __init__(self, index: int, engine: DeviceEngine, pipe: GpuPipeline, staging_bytes: int) -> None:
        from app.gpu.nms import GpuNms

        self.index = index
        self.engine = engine
        self.stream = StreamPair(pipe.device)
        self.staging = pipe._new_staging(staging_bytes)
        self.inputs = InputBuffer(pipe.max_batch, pipe.size, engine.input_dtype, pipe.device)
        self.nms = GpuNms(pipe.max_batch, pipe.meta.num_classes, pipe.meta.num_anchors, max_det=pipe.max_det)
        self.results = HostResults(pipe.max_batch, pipe.max_det)
        self.graphs = CapturedGraphs()
        self.nms_params_key: tuple | None = None
        self.launcher = None  # app.gpu.driver.RawLauncher, or None: the torch path

    def free(self) -> None:
        with contextlib.suppress(Exception):
            if self.stream.torch is not None:
                self.stream.synchronize()
        self.launcher = None
        self.graphs.free()
        self.nms.free()
        self.results.free()
        self.inputs.free()
        self.staging.free()
        self.stream.free()


class GpuPipeline:
    """Implements ``app.backends.base.Pipeline`` for a ``DeviceEngine`` (torch-cuda, TensorRT).

    ``lanes``: batches that may be in flight at once (each needs its own thread calling
    ``run``); ``jpeg_decode``: "gpu" (nvJPEG) or "cpu" (OpenCV in ``host_threads`` threads),
    may be changed between calls; ``raw_launch``: dispatch with the CUDA driver directly when
    possible (else, or on any failure setting it up, ``Tensor.copy_`` + ``CUDAGraph.replay``).
    """

    decodes_jpeg = True

    def __init__(
        self,
        engine: DeviceEngine,
        meta: ModelMeta,
        *,
        max_batch: int = 32,
        device: int = 0,
        max_det: int = 300,
        staging_bytes: int | None = None,
        lanes: int = 1,
        jpeg_decode: str = "gpu",
        host_threads: int | None = None,
        raw_launch: bool = True,
    ) -> None:
        import torch

        if max_batch < 1:
            raise InvalidParameter(f"max_batch must be >= 1, got {max_batch}")
        if max_batch > engine.max_batch:
            raise InvalidParameter(f"max_batch {max_batch} is over the engine's max_batch {engine.max_batch}")
        if lanes < 1:
            raise InvalidParameter(f"lanes must be >= 1, got {lanes}")
        self._torch = torch
        self.engine = engine
        self.backend = engine.name
        self.precision = engine.precision
        self.meta = meta
        self.max_batch = int(max_batch)
        self.device = int(device)
        self.max_det = int(max_det)
        self.size = int(meta.imgsz)
        self.buckets = bucket_sizes(self.max_batch)
        self.jpeg_decode = jpeg_decode
        self.host_threads = int(host_threads or min(8, os.cpu_count() or 1))
        self.last_timings: dict[str, float] = {}
        self.last_launch_path = ""  # "driver" | "torch": how the last batch was dispatched
        self.raw_launch_error: str | None = None  # why the driver path is off, if it is
        self._gate = _Gate()
        self._closed = False
        self._host_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._driver = None
        self._context: int | None = None

        torch.cuda.set_device(self.device)
        staging_bytes = staging_bytes or self.max_batch * self.size * self.size * 3
        self.lanes: list[_Lane] = []
        with self._numba_device():
            self.lanes.append(_Lane(0, engine, self, staging_bytes))  # lane 0 failing is fatal, as before
            for i in range(1, lanes):
                try:
                    self.lanes.append(self._extra_lane(i, staging_bytes))
                except Exception as exc:  # noqa: BLE001 - fewer lanes is slower, never wrong
                    warnings.warn(
                        f"GPU pipeline: lane {i} unavailable ({type(exc).__name__}: {exc}); "
                        f"running {len(self.lanes)} lane(s)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    break
        self._free_lanes: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        for lane in self.lanes:
            self._free_lanes.put(lane)
        if raw_launch:
            self._setup_raw_launch()
        else:
            self.raw_launch_error = "disabled (raw_launch=False)"

    # ------------------------------------------------------------------------- set-up
    @property
    def jpeg_decode(self) -> str:
        return self._jpeg_decode

    @jpeg_decode.setter
    def jpeg_decode(self, value: str) -> None:
        if value not in JPEG_DECODERS:
            raise InvalidParameter(f"jpeg_decode must be one of {', '.join(JPEG_DECODERS)}, got {value!r}")
        self._jpeg_decode = value

    @property
    def num_lanes(self) -> int:
        return len(self.lanes)

    # Lane 0's resources under their historical names (single-lane callers, tests).
    @property
    def stream(self) -> StreamPair:
        return self.lanes[0].stream

    @property
    def staging(self) -> Staging:
        return self.lanes[0].staging

    @property
    def inputs(self) -> InputBuffer:
        return self.lanes[0].inputs

    @property
    def nms(self):
        return self.lanes[0].nms

    @property
    def results(self) -> HostResults:
        return self.lanes[0].results

    @property
    def graphs(self) -> CapturedGraphs:
        return self.lanes[0].graphs

    def _extra_lane(self, index: int, staging_bytes: int) -> _Lane:
        for_lane = getattr(self.engine, "for_lane", None)
        if for_lane is None:
            raise InvalidParameter(f"the {self.engine.name} engine cannot serve several lanes (no for_lane)")
        return _Lane(index, for_lane(index), self, staging_bytes)

    def _setup_raw_launch(self) -> None:
        """The driver path, or the reason it is off. Never raises: torch's path always works."""
        try:
            from app.gpu.driver import cuda_driver

            self._driver = cuda_driver()
            self._context = self._driver.primary_context(self.device)
            if not hasattr(self._torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
                raise DeviceError("this torch has no CUDAGraph.raw_cuda_graph_exec")
            for lane in self.lanes:
                self._attach_launcher(lane)
        except Exception as exc:  # noqa: BLE001 - an optimisation, never a requirement
            self.raw_launch_error = f"{type(exc).__name__}: {exc}"
            log.warning("GPU pipeline: raw CUDA driver dispatch off (%s); using torch", self.raw_launch_error)
            for lane in self.lanes:
                lane.launcher = None
            self._release_context()

    def _attach_launcher(self, lane: _Lane) -> None:
        """(Re)build the lane's launcher for its current staging buffers."""
        lane.launcher = None
        if self._driver is None or self._context is None:
            return
        from app.gpu.driver import RawLauncher

        lane.launcher = RawLauncher(
            self._driver,
            self._context,
            stream=lane.stream.torch.cuda_stream,
            dst=lane.staging.dev.data_ptr(),
            src=lane.staging.host.data_ptr(),
        )

    def _release_context(self) -> None:
        if self._driver is not None and self._context is not None:
            with contextlib.suppress(Exception):
                self._driver.release_primary_context(self.device)
        self._context = None

    def _numba_device(self):
        """Numba's current context must be this device's (it is device 0 unless told)."""
        return cuda.gpus[self.device] if self.device != 0 else contextlib.nullcontext()

    @contextlib.contextmanager
    def _exclusive(self):
        """Nothing else runs: for captures (they call ``engine.forward``) and for ``close``."""
        with self._gate.exclusive(), self._torch.cuda.device(self.device), self._numba_device():
            yield

    def _new_staging(self, capacity: int) -> Staging:
        staging = Staging(self.max_batch, capacity, self.device)
        # A graph is captured (and warmed up) with whatever params the header holds: zeros mean
        # "empty slot", so a capture before the first batch never reads outside the buffer.
        staging.host_params[:] = 0
        staging.dev[: staging.header_bytes].zero_()
        self._torch.cuda.synchronize(self.device)
        return staging

    def _grow_staging(self, lane: _Lane, needed: int) -> None:
        """Bigger staging: new addresses, so the lane's graphs are dropped (re-captured lazily)."""
        lane.stream.synchronize()
        lane.graphs.free()
        old = lane.staging.capacity
        lane.staging.free()
        lane.staging = self._new_staging(max(needed, 2 * old))
        if lane.launcher is not None:
            try:
                self._attach_launcher(lane)
            except Exception as exc:  # noqa: BLE001 - this lane goes on through torch
                log.warning("GPU pipeline: driver dispatch off on lane %d (%s)", lane.index, exc)
                lane.launcher = None

    def _pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._host_pool is None:
                self._host_pool = ThreadPoolExecutor(
                    max_workers=self.host_threads, thread_name_prefix="yolopipe-host"
                )
            return self._host_pool

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise InvalidParameter(f"batch of {n} images is over max_batch {self.max_batch}")

    def warmup(self, buckets: Sequence[int] | None = None, *, profile: bool = False) -> None:
        """Capture the graphs of ``buckets`` (all by default) on every lane now, not on first use."""
        if self._closed:
            raise DeviceError("the GPU pipeline was closed")
        with self._exclusive():
            for lane in self.lanes:
                for b in buckets or self.buckets:
                    self._captured(lane, self.bucket_for(b), profile=profile)

    # -------------------------------------------------------------------- the steps
    def _stage_preprocess(self, lane: _Lane, batch: int) -> None:
        _, input_nb = lane.inputs.bucket(batch)
        launch_letterbox(
            lane.staging.nb_staging, lane.staging.nb_params, input_nb, batch, stream=lane.stream.numba
        )

    def _stage_engine(self, lane: _Lane, batch: int):
        input_t, _ = lane.inputs.bucket(batch)
        return lane.engine.forward(input_t)

    def _stage_nms(self, lane: _Lane, head, batch: int) -> None:
        lane.nms.run(head, batch, stream=lane.stream.numba)

    def _stage_d2h(self, lane: _Lane, batch: int) -> None:
        lane.results.enqueue_copy(lane.nms.out_rows, lane.nms.out_count, batch, lane.stream.numba)

    def _all_stages(self, lane: _Lane, batch: int):
        self._stage_preprocess(lane, batch)
        head = self._stage_engine(lane, batch)
        self._stage_nms(lane, head, batch)
        self._stage_d2h(lane, batch)
        return head

    def _captured(self, lane: _Lane, batch: int, *, profile: bool = False) -> CapturedBatch:
        """The bucket's graph on ``lane``, captured if missing. Call inside ``_exclusive``."""
        captured = lane.graphs.get(batch)
        if captured is None:
            captured = self._capture(lane, batch)
            lane.graphs.add(captured)
        if profile and not captured.stage_graphs:
            self._capture_stages(lane, captured)
        return captured

    def _capture(self, lane: _Lane, batch: int) -> CapturedBatch:
        torch = self._torch
        stream = lane.stream.torch
        try:
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self._all_stages(lane, batch)
            stream.synchronize()
            if lane.graphs.pool is None:
                lane.graphs.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=lane.graphs.pool, stream=stream):
                head = self._all_stages(lane, batch)
            stream.synchronize()
        except YolopipeError:
            raise
        except Exception as exc:
            raise DeviceError(
                f"capturing the CUDA graph of batch {batch} failed: {type(exc).__name__}: {exc}"
            ) from exc
        return CapturedBatch(batch=batch, graph=graph, head=head, graph_exec=self._graph_exec(lane, graph))

    def _graph_exec(self, lane: _Lane, graph) -> ctypes.c_void_p | None:
        """The graph's ``CUgraphExec`` for ``cuGraphLaunch``; None keeps this graph on ``replay()``.

        Launching the exec handle directly skips what ``CUDAGraph.replay()`` adds around
        ``cudaGraphLaunch``: Python replay hooks and the RNG prologue, which advances the
        Philox offsets of generators used inside the graph. These graphs use no RNG (letterbox,
        inference-mode model, NMS, copies), so nothing is skipped that they need.
        """
        if lane.launcher is None:
            return None
        try:
            handle = int(graph.raw_cuda_graph_exec())
        except Exception as exc:  # noqa: BLE001 - this graph goes through replay() instead
            log.warning(
                "GPU pipeline: no raw graph exec handle (%s: %s); replaying through torch",
                type(exc).__name__,
                exc,
            )
            return None
        return ctypes.c_void_p(handle) if handle else None

    def _capture_stages(self, lane: _Lane, captured: CapturedBatch) -> None:
        torch = self._torch
        stream = lane.stream.torch
        batch = captured.batch
        pool = lane.graphs.pool
        graphs = {name: torch.cuda.CUDAGraph() for name in STAGES}
        with torch.cuda.graph(graphs["preprocess"], pool=pool, stream=stream):
            self._stage_preprocess(lane, batch)
        with torch.cuda.graph(graphs["engine"], pool=pool, stream=stream):
            head = self._stage_engine(lane, batch)
        with torch.cuda.graph(graphs["nms"], pool=pool, stream=stream):
            self._stage_nms(lane, head, batch)
        with torch.cuda.graph(graphs["d2h"], pool=pool, stream=stream):
            self._stage_d2h(lane, batch)
        stream.synchronize()
        captured.stage_graphs = graphs
        captured.stage_head = head

    def _set_nms_params(self, lane: _Lane, params: DetectParams) -> None:
        if params.max_det > self.max_det:
            raise InvalidParameter(
                f"max_det {params.max_det} is over this pipeline's {self.max_det}",
                hint="start the GPU pipeline with a larger max_det",
            )
        key = (params.conf, params.iou, params.max_det, params.classes, params.agnostic)
        if key != lane.nms_params_key:  # device params persist: rewrite only on change
            with self._numba_device():
                lane.nms.set_params(
                    conf=params.conf,
                    iou=params.iou,
                    max_det=params.max_det,
                    classes=params.classes,
                    agnostic=params.agnostic,
                    stream=lane.stream.numba,
                )
            lane.nms_params_key = key

    # --------------------------------------------------------------------------- run
    def run(
        self, images: Sequence[PipelineInput], params: DetectParams, *, profile: bool = False
    ) -> list[tuple[np.ndarray, Letterbox] | YolopipeError]:
        """One batch. Thread-safe: up to ``num_lanes`` calls run at once, more wait for a lane."""
        if self._closed:
            raise DeviceError("the GPU pipeline was closed")
        n = len(images)
        if n == 0:
            return []
        if n > self.max_batch:
            raise InvalidParameter(f"batch of {n} images is over max_batch {self.max_batch}")
        lane = self._free_lanes.get()
        try:
            self._gate.acquire_shared()
            try:
                if self._closed:
                    raise DeviceError("the GPU pipeline was closed")
                return self._run(lane, images, params, profile)
            except YolopipeError:
                raise
            except Exception as exc:  # a CUDA failure: say which, keep the type family
                raise DeviceError(f"GPU pipeline failed: {type(exc).__name__}: {exc}") from exc
            finally:
                self._gate.release_shared()
        finally:
            self._free_lanes.put(lane)

    def _capture_while_shared(self, lane: _Lane, bucket: int, profile: bool) -> CapturedBatch:
        """Capture from inside a run: give up the share, capture alone, take the share back."""
        self._gate.release_shared()
        try:
            with self._exclusive():
                if self._closed:
                    raise DeviceError("the GPU pipeline was closed")
                return self._captured(lane, bucket, profile=profile)
        finally:
            self._gate.acquire_shared()

    def _decode(self, lane: _Lane, datas: list[bytes]) -> list:
        if self._jpeg_decode == "cpu":
            if len(datas) == 1:
                return [_cpu_decode(datas[0])]
            return list(self._pool().map(_cpu_decode, datas))
        with self._torch.cuda.stream(lane.stream.torch):  # nvJPEG and its copies on this lane's stream
            return decode_jpegs(datas, self.device)

    def _copy_frames(self, host_np: np.ndarray, copies: list[tuple[int, np.ndarray]]) -> None:
        """Frames into the pinned staging at their offsets; a large batch in the host pool."""

        def copy(indices: range) -> None:
            for k in indices:
                offset, img = copies[k]
                np.copyto(host_np[offset : offset + img.nbytes].reshape(img.shape), img)

        if len(copies) >= PARALLEL_PACK_MIN and self.host_threads > 1:
            list(self._pool().map(copy, split_even(len(copies), self.host_threads)))
        else:
            copy(range(len(copies)))

    def _run(self, lane: _Lane, images: Sequence[PipelineInput], params: DetectParams, profile: bool):
        torch = self._torch
        stream = lane.stream.torch
        timings: dict[str, float] = {}
        t_start = time.perf_counter()
        results: list[Any] = [None] * len(images)

        # 1. decode: JPEG bytes on the GPU (nvJPEG) or the CPU, anything else taken as a BGR frame.
        ev_decode = None
        if profile:
            ev_decode = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev_decode[0].record(stream)
        byte_slots = [i for i, x in enumerate(images) if isinstance(x, (bytes, bytearray, memoryview))]
        decoded = self._decode(lane, [bytes(images[i]) for i in byte_slots]) if byte_slots else []
        if profile:
            ev_decode[1].record(stream)  # nvJPEG work was made to precede this on our stream
        host_items: list[tuple[int, np.ndarray]] = []  # (result slot, BGR HWC uint8)
        dev_items: list[tuple[int, Any]] = []  # (result slot, RGB CHW uint8 CUDA tensor)
        by_slot = dict(zip(byte_slots, decoded))
        for i, item in enumerate(images):
            value = by_slot.get(i, item)
            if isinstance(value, YolopipeError):
                results[i] = value
            elif isinstance(value, np.ndarray):
                if value.ndim != 3 or value.shape[2] != 3 or value.dtype != np.uint8 or 0 in value.shape:
                    results[i] = InvalidImage(
                        f"frames must be BGR uint8 [H, W, 3], got {value.dtype} {value.shape}"
                    )
                else:
                    host_items.append((i, value))
            else:
                dev_items.append((i, value))
        t_decoded = time.perf_counter()
        timings["decode_ms"] = (t_decoded - t_start) * 1e3
        n_ok = len(host_items) + len(dev_items)
        if n_ok == 0:
            self.last_timings = timings
            return results
        bucket = self.bucket_for(n_ok)

        # 2. placement and staging layout: [header | frames (host) | decoded JPEGs (device)].
        host_sizes = [align_up(img.nbytes, IMAGE_ALIGN) for _, img in host_items]
        dev_sizes = [int(t.numel()) for _, t in dev_items]
        host_end = lane.staging.header_bytes + sum(host_sizes)
        dev_start = align_up(host_end)
        needed = dev_start + sum(dev_sizes) - lane.staging.header_bytes
        if needed > lane.staging.capacity:
            self._grow_staging(lane, needed)
        staging = lane.staging
        host_params = staging.host_params
        placed: list[tuple[int, Letterbox]] = []  # batch slot j → (result slot, placement)
        copies: list[tuple[int, np.ndarray]] = []
        offset = staging.header_bytes
        for (i, img), nbytes in zip(host_items, host_sizes):
            h, w = img.shape[:2]
            lb = letterbox_placement(h, w, self.size)
            copies.append((offset, img))
            fill_params(host_params[len(placed)], lb, offset, LAYOUT_HWC_BGR)
            placed.append((i, lb))
            offset += nbytes
        self._copy_frames(staging.host_np, copies)
        offset = dev_start
        for (i, t), nbytes in zip(dev_items, dev_sizes):
            lb = letterbox_placement(int(t.shape[1]), int(t.shape[2]), self.size)
            fill_params(host_params[len(placed)], lb, offset, LAYOUT_CHW_RGB)
            placed.append((i, lb))
            offset += nbytes
        for j in range(len(placed), bucket):
            fill_params(host_params[j], None, 0, 0)  # padding slots: all pad, never read pixels
        self._set_nms_params(lane, params)
        captured = lane.graphs.get(bucket)
        if captured is None or (profile and not captured.stage_graphs):
            captured = self._capture_while_shared(lane, bucket, profile)
        ev_pack = None
        if dev_items:
            # Decoded JPEGs are packed on the device, on the lane's stream, before the upload and
            # the launch: host work of the pack step, not of the dispatch.
            t0 = time.perf_counter()
            if profile:
                ev_pack = torch.cuda.Event(enable_timing=True)
                ev_pack.record(stream)
            with torch.cuda.stream(stream):
                torch.cat([t.reshape(-1) for _, t in dev_items], out=staging.dev[dev_start:offset])
            timings["device_pack_us"] = (time.perf_counter() - t0) * 1e6
        t_packed = time.perf_counter()
        timings["pack_ms"] = (t_packed - t_decoded) * 1e3

        # 3. dispatch: H2D of [header | frames] and one graph launch.
        if profile:
            timings.update(self._profiled_replay(lane, captured, host_end, ev_decode, ev_pack))
            path = "torch"
        else:
            t0 = time.perf_counter()
            path = self._dispatch(lane, captured, host_end)
            timings["dispatch_us"] = (time.perf_counter() - t0) * 1e6
        timings["raw_launch"] = 1.0 if path == "driver" else 0.0
        t_enqueued = time.perf_counter()
        stream.synchronize()
        t_done = time.perf_counter()
        timings["wait_ms"] = (t_done - t_enqueued) * 1e3

        # 4. rows per image.
        counts = lane.results.counts
        rows = lane.results.rows
        for j, (i, lb) in enumerate(placed):
            k = int(counts[j])
            results[i] = (rows[j, :k].copy(), lb)
        t_end = time.perf_counter()
        timings["unpack_ms"] = (t_end - t_done) * 1e3
        timings["total_ms"] = (t_end - t_start) * 1e3
        timings["batch"] = float(len(placed))
        timings["bucket"] = float(bucket)
        timings["lane"] = float(lane.index)
        self.last_timings = timings
        self.last_launch_path = path
        return results

    def _dispatch(self, lane: _Lane, captured: CapturedBatch, host_end: int) -> str:
        """Enqueue the upload and the graph on the lane's stream; returns the path taken."""
        launcher = lane.launcher
        if launcher is not None and captured.graph_exec is not None:
            try:
                launcher.make_current()
                launcher.upload(host_end)
                launcher.launch(captured.graph_exec)
                return "driver"
            except DeviceError as exc:
                # Conservative: this lane goes back to torch for good, and the batch is enqueued
                # again that way (re-uploading the same bytes is harmless; a failed launch ran
                # nothing). A real device fault will fail there too, as a DeviceError.
                log.warning(
                    "GPU pipeline: driver dispatch failed on lane %d (%s); using torch", lane.index, exc
                )
                lane.launcher = None
        torch = self._torch
        staging = lane.staging
        with torch.cuda.stream(lane.stream.torch):
            staging.dev[:host_end].copy_(staging.host[:host_end], non_blocking=True)
            captured.graph.replay()  # replays on the current stream: the lane's
        return "torch"

    def _profiled_replay(self, lane: _Lane, captured, host_end, ev_decode, ev_pack) -> dict[str, float]:
        """The same work as one replay, stage by stage with CUDA events between the stages."""
        torch = self._torch
        stream = lane.stream.torch
        staging = lane.staging
        ev = {name: torch.cuda.Event(enable_timing=True) for name in ("h2d", *STAGES, "end")}
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            ev["h2d"].record(stream)
            staging.dev[:host_end].copy_(staging.host[:host_end], non_blocking=True)
            for name in STAGES:
                ev[name].record(stream)
                captured.stage_graphs[name].replay()
            ev["end"].record(stream)
        t1 = time.perf_counter()
        stream.synchronize()
        order = ["h2d", *STAGES, "end"]
        out = {"dispatch_us": (t1 - t0) * 1e6, "gpu_decode_ms": ev_decode[0].elapsed_time(ev_decode[1])}
        if ev_pack is not None:
            out["gpu_pack_ms"] = ev_pack.elapsed_time(ev["h2d"])
        for a, b in itertools.pairwise(order):
            out[f"gpu_{a}_ms"] = ev[a].elapsed_time(ev[b])
        out["gpu_total_ms"] = ev["h2d"].elapsed_time(ev["end"])
        return out

    # ----------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Free every device resource (idempotent), then the engine(s)."""
        if self._closed:
            return
        self._closed = True
        with self._gate.exclusive():  # waits for the batches in flight
            engines = []
            for lane in self.lanes:
                lane.free()
                if lane.engine is not self.engine and all(lane.engine is not e for e in engines):
                    engines.append(lane.engine)
            for extra in engines:
                with contextlib.suppress(Exception):
                    extra.close()
            self.engine.close()
            if self._host_pool is not None:
                self._host_pool.shutdown(wait=True)
                self._host_pool = None
            self._release_context()

    def __enter__(self) -> GpuPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
