"""The GPU request path: images → boxes with one CUDA-graph replay per batch.

Per batch the host does only this:

1. decode JPEG bytes with nvJPEG (batched) or take decoded BGR frames;
2. pack frames into the pinned staging buffer after the per-image params header; decoded
   JPEGs are already on the device and are packed there with one ``torch.cat(..., out=...)``;
3. if the request parameters changed, write them to the NMS's device params (rare);
4. enqueue one H2D copy of ``[params header | frames]`` and **one graph replay**;
5. one stream sync, then slice each image's rows by its count.

The graph of a bucket (1, 2, 4, ... ``max_batch``; a batch is padded up to its bucket with
empty slots) holds, all on the pipeline's one non-default stream:

    letterbox kernel → engine.forward(input) → GpuNms.run(head) → D2H of rows + counts

The NMS reads the engine's output where the engine wrote it (``__cuda_array_interface__``,
no copy); the only device→host traffic is the final copy into pinned memory.

Profiling (``run(..., profile=True)``): CUDA events cannot be recorded between the nodes of
one graph, so that path replays four graphs captured per stage (preprocess, engine, NMS, D2H)
with events between them. The stages run the same kernels on the same buffers as the full
graph; only the engine's head lives in a second tensor.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Sequence
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
    decode_jpegs,
    fill_params,
    launch_letterbox,
    letterbox_placement,
)
from app.types import DetectParams, Letterbox, ModelMeta

WARMUP_RUNS = 2  # eager runs per bucket before capture (kernel loading, cuDNN autotune, compile)
IMAGE_ALIGN = 16  # byte alignment of each frame in the staging buffer
STAGES = ("preprocess", "engine", "nms", "d2h")


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (which is always the last bucket)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


class GpuPipeline:
    """Implements ``app.backends.base.Pipeline`` for a ``DeviceEngine`` (torch-cuda, TensorRT)."""

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
    ) -> None:
        import torch

        from app.gpu.nms import GpuNms

        if max_batch < 1:
            raise InvalidParameter(f"max_batch must be >= 1, got {max_batch}")
        if max_batch > engine.max_batch:
            raise InvalidParameter(f"max_batch {max_batch} is over the engine's max_batch {engine.max_batch}")
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
        self.last_timings: dict[str, float] = {}
        self._lock = threading.Lock()
        self._nms_params_key: tuple | None = None
        self._closed = False

        torch.cuda.set_device(self.device)
        with self._numba_device():
            self.stream = StreamPair(self.device)
            default_staging = self.max_batch * self.size * self.size * 3
            self.staging = self._new_staging(staging_bytes or default_staging)
            self.inputs = InputBuffer(self.max_batch, self.size, engine.input_dtype, self.device)
            self.nms = GpuNms(self.max_batch, meta.num_classes, meta.num_anchors, max_det=self.max_det)
            self.results = HostResults(self.max_batch, self.max_det)
            self.graphs = CapturedGraphs()

    # ------------------------------------------------------------------------- set-up
    def _numba_device(self):
        """Numba's current context must be this device's (it is device 0 unless told)."""
        return cuda.gpus[self.device] if self.device != 0 else contextlib.nullcontext()

    def _new_staging(self, capacity: int) -> Staging:
        staging = Staging(self.max_batch, capacity, self.device)
        # A graph is captured (and warmed up) with whatever params the header holds: zeros mean
        # "empty slot", so a capture before the first batch never reads outside the buffer.
        staging.host_params[:] = 0
        staging.dev[: staging.header_bytes].zero_()
        self._torch.cuda.synchronize(self.device)
        return staging

    def _grow_staging(self, needed: int) -> None:
        """Bigger staging: new addresses, so every captured graph is dropped (re-captured lazily)."""
        self.stream.synchronize()
        self.graphs.free()
        old = self.staging.capacity
        self.staging.free()
        self.staging = self._new_staging(max(needed, 2 * old))

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise InvalidParameter(f"batch of {n} images is over max_batch {self.max_batch}")

    def warmup(self, buckets: Sequence[int] | None = None, *, profile: bool = False) -> None:
        """Capture the graphs of ``buckets`` (all by default) now instead of on first use."""
        with self._lock, self._numba_device():
            for b in buckets or self.buckets:
                self._captured(self.bucket_for(b), profile=profile)

    # -------------------------------------------------------------------- the steps
    def _stage_preprocess(self, batch: int) -> None:
        _, input_nb = self.inputs.bucket(batch)
        launch_letterbox(self.staging.nb_staging, self.staging.nb_params, input_nb, batch, stream=self.stream.numba)

    def _stage_engine(self, batch: int):
        input_t, _ = self.inputs.bucket(batch)
        return self.engine.forward(input_t)

    def _stage_nms(self, head, batch: int) -> None:
        self.nms.run(head, batch, stream=self.stream.numba)

    def _stage_d2h(self, batch: int) -> None:
        self.results.enqueue_copy(self.nms.out_rows, self.nms.out_count, batch, self.stream.numba)

    def _all_stages(self, batch: int):
        self._stage_preprocess(batch)
        head = self._stage_engine(batch)
        self._stage_nms(head, batch)
        self._stage_d2h(batch)
        return head

    def _captured(self, batch: int, *, profile: bool = False) -> CapturedBatch:
        """The bucket's graph, captured on first use (after ``WARMUP_RUNS`` eager runs)."""
        captured = self.graphs.get(batch)
        if captured is None:
            captured = self._capture(batch)
            self.graphs.add(captured)
        if profile and not captured.stage_graphs:
            self._capture_stages(captured)
        return captured

    def _capture(self, batch: int) -> CapturedBatch:
        torch = self._torch
        stream = self.stream.torch
        try:
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self._all_stages(batch)
            stream.synchronize()
            if self.graphs.pool is None:
                self.graphs.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graphs.pool, stream=stream):
                head = self._all_stages(batch)
            stream.synchronize()
        except YolopipeError:
            raise
        except Exception as exc:
            raise DeviceError(f"capturing the CUDA graph of batch {batch} failed: {type(exc).__name__}: {exc}") from exc
        return CapturedBatch(batch=batch, graph=graph, head=head)

    def _capture_stages(self, captured: CapturedBatch) -> None:
        torch = self._torch
        stream = self.stream.torch
        batch = captured.batch
        graphs = {name: torch.cuda.CUDAGraph() for name in STAGES}
        with torch.cuda.graph(graphs["preprocess"], pool=self.graphs.pool, stream=stream):
            self._stage_preprocess(batch)
        with torch.cuda.graph(graphs["engine"], pool=self.graphs.pool, stream=stream):
            head = self._stage_engine(batch)
        with torch.cuda.graph(graphs["nms"], pool=self.graphs.pool, stream=stream):
            self._stage_nms(head, batch)
        with torch.cuda.graph(graphs["d2h"], pool=self.graphs.pool, stream=stream):
            self._stage_d2h(batch)
        stream.synchronize()
        captured.stage_graphs = graphs
        captured.stage_head = head

    def _set_nms_params(self, params: DetectParams) -> None:
        if params.max_det > self.max_det:
            raise InvalidParameter(
                f"max_det {params.max_det} is over this pipeline's {self.max_det}",
                hint="start the GPU pipeline with a larger max_det",
            )
        key = (params.conf, params.iou, params.max_det, params.classes, params.agnostic)
        if key != self._nms_params_key:  # device params persist: rewrite only on change
            self.nms.set_params(
                conf=params.conf,
                iou=params.iou,
                max_det=params.max_det,
                classes=params.classes,
                agnostic=params.agnostic,
                stream=self.stream.numba,
            )
            self._nms_params_key = key

    # --------------------------------------------------------------------------- run
    def run(
        self, images: Sequence[PipelineInput], params: DetectParams, *, profile: bool = False
    ) -> list[tuple[np.ndarray, Letterbox] | YolopipeError]:
        if self._closed:
            raise DeviceError("the GPU pipeline was closed")
        n = len(images)
        if n == 0:
            return []
        if n > self.max_batch:
            raise InvalidParameter(f"batch of {n} images is over max_batch {self.max_batch}")
        with self._lock, self._numba_device(), self._torch.cuda.stream(self.stream.torch):
            try:
                return self._run(images, params, profile)
            except YolopipeError:
                raise
            except Exception as exc:  # a CUDA failure: say which, keep the type family
                raise DeviceError(f"GPU pipeline failed: {type(exc).__name__}: {exc}") from exc

    def _run(self, images: Sequence[PipelineInput], params: DetectParams, profile: bool):
        torch = self._torch
        stream = self.stream.torch
        timings: dict[str, float] = {}
        t_start = time.perf_counter()
        results: list[Any] = [None] * len(images)

        # 1. decode: JPEG bytes on the GPU (nvJPEG), anything else taken as a BGR frame.
        if profile:
            ev_decode = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev_decode[0].record(stream)
        byte_slots = [i for i, x in enumerate(images) if isinstance(x, (bytes, bytearray, memoryview))]
        decoded = decode_jpegs([bytes(images[i]) for i in byte_slots], self.device) if byte_slots else []
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
                    results[i] = InvalidImage(f"frames must be BGR uint8 [H, W, 3], got {value.dtype} {value.shape}")
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
        host_end = self.staging.header_bytes + sum(host_sizes)
        dev_start = align_up(host_end)
        needed = dev_start + sum(dev_sizes) - self.staging.header_bytes
        if needed > self.staging.capacity:
            self._grow_staging(needed)
        staging = self.staging
        host_params = staging.host_params
        placed: list[tuple[int, Letterbox]] = []  # batch slot j → (result slot, placement)
        offset = staging.header_bytes
        for (i, img), nbytes in zip(host_items, host_sizes):
            h, w = img.shape[:2]
            lb = letterbox_placement(h, w, self.size)
            np.copyto(staging.host_np[offset : offset + img.nbytes].reshape(h, w, 3), img)
            fill_params(host_params[len(placed)], lb, offset, LAYOUT_HWC_BGR)
            placed.append((i, lb))
            offset += nbytes
        offset = dev_start
        for (i, t), nbytes in zip(dev_items, dev_sizes):
            lb = letterbox_placement(int(t.shape[1]), int(t.shape[2]), self.size)
            fill_params(host_params[len(placed)], lb, offset, LAYOUT_CHW_RGB)
            placed.append((i, lb))
            offset += nbytes
        for j in range(len(placed), bucket):
            fill_params(host_params[j], None, 0, 0)  # padding slots: all pad, never read pixels
        self._set_nms_params(params)
        captured = self._captured(bucket, profile=profile)
        t_packed = time.perf_counter()
        timings["pack_ms"] = (t_packed - t_decoded) * 1e3

        # 3. enqueue: H2D of [header | frames], device-side pack of decoded JPEGs, one replay.
        if profile:
            timings.update(self._profiled_replay(captured, host_end, dev_items, dev_start, dev_sizes, ev_decode))
        else:
            t0 = time.perf_counter()
            staging.dev[:host_end].copy_(staging.host[:host_end], non_blocking=True)
            if dev_items:
                torch.cat([t.reshape(-1) for _, t in dev_items], out=staging.dev[dev_start:offset])
            captured.graph.replay()
            t1 = time.perf_counter()
            timings["dispatch_us"] = (t1 - t0) * 1e6
        t_enqueued = time.perf_counter()
        stream.synchronize()
        t_done = time.perf_counter()
        timings["wait_ms"] = (t_done - t_enqueued) * 1e3

        # 4. rows per image.
        counts = self.results.counts
        rows = self.results.rows
        for j, (i, lb) in enumerate(placed):
            k = int(counts[j])
            results[i] = (rows[j, :k].copy(), lb)
        t_end = time.perf_counter()
        timings["unpack_ms"] = (t_end - t_done) * 1e3
        timings["total_ms"] = (t_end - t_start) * 1e3
        timings["batch"] = float(len(placed))
        timings["bucket"] = float(bucket)
        self.last_timings = timings
        return results

    def _profiled_replay(self, captured, host_end, dev_items, dev_start, dev_sizes, ev_decode) -> dict[str, float]:
        """The same work as one replay, stage by stage with CUDA events between the stages."""
        torch = self._torch
        stream = self.stream.torch
        staging = self.staging
        ev = {name: torch.cuda.Event(enable_timing=True) for name in ("h2d", *STAGES, "end")}
        t0 = time.perf_counter()
        ev["h2d"].record(stream)
        staging.dev[:host_end].copy_(staging.host[:host_end], non_blocking=True)
        if dev_items:
            end = dev_start + sum(dev_sizes)
            torch.cat([t.reshape(-1) for _, t in dev_items], out=staging.dev[dev_start:end])
        for name in STAGES:
            ev[name].record(stream)
            captured.stage_graphs[name].replay()
        ev["end"].record(stream)
        t1 = time.perf_counter()
        stream.synchronize()
        order = ["h2d", *STAGES, "end"]
        out = {"dispatch_us": (t1 - t0) * 1e6, "gpu_decode_ms": ev_decode[0].elapsed_time(ev_decode[1])}
        for a, b in itertools.pairwise(order):
            out[f"gpu_{a}_ms"] = ev[a].elapsed_time(ev[b])
        out["gpu_total_ms"] = ev["h2d"].elapsed_time(ev["end"])
        return out

    # ----------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Free every device resource (idempotent), then the engine."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            with contextlib.suppress(Exception):
                self.stream.synchronize()
            self.graphs.free()
            self.nms.free()
            self.results.free()
            self.inputs.free()
            self.staging.free()
            self.stream.free()
            self.engine.close()

    def __enter__(self) -> GpuPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
