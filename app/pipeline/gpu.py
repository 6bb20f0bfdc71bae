"""The GPU request path: images → boxes, with the stages of consecutive batches overlapped.

One batch, stage by stage (the module that does each):

1. **decode** (``app.gpu.decode``): each JPEG's place in the slot's device staging is planned
   from its header (the one its first reader parsed, ``EncodedImage``; a JPEG whose bytes cannot
   decode whole is OpenCV's error here), zeroed, then it is decoded there on the decoder's own
   stream (nvImageCodec by default), or by OpenCV in the host threads (``decode="opencv"``); a
   JPEG joins the batch only as its decoder reported it decoded; frames are taken as they are;
2. **staging** (``app.gpu.pack``): an event on the decoder's stream after the batch's decode,
   then the params header and the frames into the slot's pinned staging;
3. **upload**: one H2D copy of ``[header | frames]`` on the copy stream, then an event;
4. **graph** (``app.gpu.capture``): letterbox → engine → NMS → D2H of the rows, one graph
   launch on the compute stream once both events have fired, then the slot's ``done`` event;
5. **unpack**: rows per image, once ``done`` has fired.

Device NV12 frames (NVDEC's) take steps 1-2 from ``app.gpu.nv12_input``: copies device to
device into the slot's staging, then the bucket's NV12 graph.

``run`` is thread-safe and takes one of ``in_flight`` batch slots (``app.gpu.slot``) for the
whole batch, so up to ``in_flight`` threads calling it keep that many batches in flight: while
batch N's graph runs, batch N+1 is decoded and uploaded into its own slot and batch N−1's rows
are unpacked from theirs. Every wait releases the GIL (nvImageCodec, NumPy copies, the event
wait), so the compute stream is fed as long as the host work of a batch takes less time than
its graph. ``app.pipeline.overlap`` drives a stream of batches that way (folder inference,
the benchmark); ``in_flight`` says how many are worth having in flight.

Graph launches are made straight through the CUDA driver (``app.gpu.driver.RawDispatch``;
``Tensor.copy_`` + ``CUDAGraph.replay()`` if that is unavailable). Captures run with the gate
held exclusively (``app.gpu.gate``): no other thread makes CUDA calls while one is captured;
and every capture runs on the one capture thread of ``app.gpu.capture`` (the same kernels in
every graph of a bucket, whichever thread asked: the same answer in any slot).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from numba import cuda

from app.config import IN_FLIGHT, MAX_DET, MAX_PIXELS, decoder_name
from app.contracts import DetectParams, DeviceEngine, DeviceNv12, EncodedImage, PipelineInput, PipelineRun
from app.errors import DeviceError, InvalidParameter, YolopipeError
from app.gpu import nv12_input
from app.gpu.capture import GraphBuilder, graph_key
from app.gpu.decode import make_decoder
from app.gpu.decoded import GpuJpegDecoder, cpu_decode, decoded_size
from app.gpu.dispatch import Dispatcher
from app.gpu.gate import Gate
from app.gpu.memory import CapturedBatch, InputBuffer, StreamPair
from app.gpu.pack import bucket_sizes, checked_frames, copy_frames, plan_batch, settle_decoded, write_header
from app.gpu.slot import BatchSlot
from app.gpu.timeline import Timeline
from app.types import ModelMeta


class GpuPipeline:
    """Implements ``app.contracts.Pipeline`` for a ``DeviceEngine`` (torch-cuda, TensorRT).

    ``in_flight``: batches in flight at once (a ``BatchSlot`` each); ``decode``: ``gpu`` |
    ``nvimgcodec`` | ``nvjpeg`` | ``opencv`` (``app.gpu.decode``), changeable between calls;
    ``max_pixels``: the limit OpenCV's decodes are held to; ``host_threads``: the pool that packs
    frames and decodes with OpenCV; ``raw_launch``: dispatch through the CUDA driver directly
    when possible.
    """

    decodes_jpeg = True
    takes_nv12 = True

    def __init__(
        self,
        engine: DeviceEngine,
        meta: ModelMeta,
        *,
        max_batch: int = 32,
        device: int = 0,
        max_det: int = MAX_DET,
        staging_bytes: int | None = None,
        in_flight: int = IN_FLIGHT,
        decode: str = "gpu",
        max_pixels: int = MAX_PIXELS,
        host_threads: int | None = None,
        raw_launch: bool = True,
        pad_to_captured: bool = False,
    ) -> None:
        import torch

        if max_batch < 1:
            raise InvalidParameter(f"max_batch must be >= 1, got {max_batch}")
        if max_batch > engine.max_batch:
            raise InvalidParameter(f"max_batch {max_batch} is over the engine's max_batch {engine.max_batch}")
        if in_flight < 1:
            raise InvalidParameter(f"in_flight must be >= 1, got {in_flight}")
        self._torch = torch
        self.engine = engine
        self.backend = engine.name
        self.precision = engine.precision
        self.meta = meta
        self.max_batch = int(max_batch)
        self.in_flight = int(in_flight)
        self.max_pixels = int(max_pixels)
        self.device = int(device)
        self.max_det = int(max_det)
        self.size = int(meta.imgsz)
        self.buckets = tuple(bucket_sizes(self.max_batch))
        self.host_threads = int(host_threads or min(16, os.cpu_count() or 1))
        self.last_launch_path = ""  # "driver" | "torch": how the last batch was dispatched
        self.pad_to_captured = pad_to_captured  # see _bucket_to_run
        self._gate = Gate()
        self._closed = False
        self._host_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._decoders: dict[str, GpuJpegDecoder | None] = {}
        self._timeline: Timeline | None = None

        torch.cuda.set_device(self.device)
        with self._numba_device():
            self.compute = StreamPair(self.device)
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self.inputs = InputBuffer(self.max_batch, self.size, engine.input_dtype, self.device)
            staging_bytes = staging_bytes or self.max_batch * self.size * self.size * 3
            self.slots = [
                BatchSlot(i, max_batch=self.max_batch, max_det=self.max_det, meta=meta, device=self.device,
                          staging_bytes=staging_bytes)
                for i in range(in_flight)
            ]
            self.graphs = GraphBuilder(engine, self.inputs, self.compute, self.slots, context=self._on_device)
        self._first_staging = self.slots[0].staging.capacity  # release_memory shrinks grown staging back to it
        self._free_slots: queue.SimpleQueue[BatchSlot] = queue.SimpleQueue()
        for slot in self.slots:
            self._free_slots.put(slot)
        self.decode = decode  # creates the decoder now, so a missing library shows at start-up
        self.dispatcher = Dispatcher(self.device, self.compute, self.copy_stream, raw_launch=raw_launch)
        self.dispatcher.setup(self.slots)

    # ------------------------------------------------------------------------- set-up
    @property
    def decode(self) -> str:
        return self._decode

    @decode.setter
    def decode(self, value: str) -> None:
        value = decoder_name(value)
        if value not in self._decoders:
            self._decoders[value] = make_decoder(value, self.device, self.host_threads)
        self._decode = value

    @property
    def raw_launch_error(self) -> str | None:
        """Why graphs are not launched through the CUDA driver directly, or None if they are."""
        return self.dispatcher.raw_launch_error

    @property
    def decoder_name(self) -> str:
        """What decodes JPEG now: ``nvimgcodec``, ``nvjpeg`` or ``opencv``."""
        decoder = self._decoders[self._decode]
        return decoder.name if decoder is not None else "opencv"

    def _numba_device(self):
        """Numba's current context must be this device's (it is device 0 unless told)."""
        return cuda.gpus[self.device] if self.device != 0 else contextlib.nullcontext()

    @contextlib.contextmanager
    def _on_device(self):
        """This pipeline's device for torch and Numba, on the calling thread (the capture thread's)."""
        with self._torch.cuda.device(self.device), self._numba_device():
            yield

    @contextlib.contextmanager
    def _exclusive(self):
        """Nothing else runs: for captures (they call ``engine.forward``) and for ``close``."""
        with self._gate.exclusive(), self._torch.cuda.device(self.device), self._numba_device():
            yield

    def _pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._host_pool is None:
                self._host_pool = ThreadPoolExecutor(max_workers=self.host_threads, thread_name_prefix="yolopipe-host")
            return self._host_pool

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise InvalidParameter(f"batch of {n} images is over max_batch {self.max_batch}")

    def _bucket_to_run(self, slot: BatchSlot, n: int, nv12: bool = False) -> int:
        """The bucket ``n`` images run in on ``slot``: the smallest that takes them, its graph
        captured now if missing; with ``pad_to_captured``, the smallest that takes them among
        those already captured there, if any, so that a bucket a run needs once (a folder's last
        batch) or while the service is still capturing the others costs no capture."""
        exact = self.bucket_for(n)
        if self.pad_to_captured and slot.graphs.get(graph_key(exact, nv12)) is None:
            for b in self.buckets:
                if b > exact and slot.graphs.get(graph_key(b, nv12)) is not None:
                    return b
        return exact

    def warmup(self, batches: Sequence[int] | None = None, *, profile: bool = False, nv12: bool = False) -> None:
        """Capture the graphs of the buckets of ``batches`` (all by default) on every slot now;
        ``nv12``: those of device NV12 batches instead of images'."""
        if self._closed:
            raise DeviceError("the GPU pipeline was closed")
        with self._exclusive():
            for slot in self.slots:
                for b in sorted({self.bucket_for(b) for b in (batches or self.buckets)}):
                    self.graphs.captured(slot, b, profile=profile, raw_exec=slot.dispatch is not None, nv12=nv12)

    # ---------------------------------------------------------------------- timeline
    def start_timeline(self) -> Timeline:
        """Record CUDA events per stage for every batch from now on (``app.gpu.timeline``)."""
        self._timeline = Timeline(self.compute.torch)
        return self._timeline

    def stop_timeline(self) -> Timeline | None:
        timeline, self._timeline = self._timeline, None
        return timeline

    # --------------------------------------------------------------------------- run
    def run(self, images: Sequence[PipelineInput], params: DetectParams, *, profile: bool = False) -> PipelineRun:
        """One batch; thread-safe: up to ``in_flight`` calls overlap, more wait for a slot."""
        if self._closed:
            raise DeviceError("the GPU pipeline was closed")
        n = len(images)
        if n == 0:
            return PipelineRun([])
        if n > self.max_batch:
            raise InvalidParameter(f"batch of {n} images is over max_batch {self.max_batch}")
        if params.max_det > self.max_det:
            raise InvalidParameter(
                f"max_det {params.max_det} is over this pipeline's {self.max_det}",
                hint="start the GPU pipeline with a larger max_det",
            )
        slot = self._free_slots.get()
        try:
            self._gate.acquire_shared()
            try:
                if self._closed:
                    raise DeviceError("the GPU pipeline was closed")
                return self._run(slot, images, params, profile)
            except YolopipeError:
                raise
            except Exception as exc:  # a CUDA failure: say which, keep the type family
                raise DeviceError(f"GPU pipeline failed: {type(exc).__name__}: {exc}") from exc
            finally:
                self._gate.release_shared()
        finally:
            self._free_slots.put(slot)

    def _run(self, slot: BatchSlot, images: Sequence[PipelineInput], params: DetectParams, profile: bool):
        if any(isinstance(x, DeviceNv12) for x in images):
            return self._run_nv12(slot, images, params, profile)
        timings: dict[str, float] = {}
        t_start = time.perf_counter()
        results: list[Any] = [None] * len(images)
        encoded = [i for i, x in enumerate(images) if isinstance(x, EncodedImage)]  # positions of the JPEGs
        frames = checked_frames(images, set(encoded), results)
        decoder = self._decoders[self._decode] if encoded else None
        timeline = self._timeline
        marks = timeline.begin(len(images), ("decode", "upload", "compute") if decoder else ("upload", "compute")) \
            if timeline is not None else None

        # 1-2. decode and plan; JPEGs decoded on the GPU go straight into their place (under the decoder's lock).
        with decoder.lock if decoder is not None else contextlib.nullcontext():
            if marks is not None and decoder is not None:
                marks.record("decode", False, decoder.stream)
            jpegs: list[EncodedImage] = [images[i] for i in encoded]  # type: ignore[misc]
            datas = [x.data for x in jpegs]
            gpu: list = []
            if decoder is None:
                host = dict(enumerate(self._cpu_decode(jpegs))) if jpegs else {}
            else:  # routed by the headers that came with the bytes: none is parsed again
                gpu, host = decoder.split(datas, [x.header for x in jpegs])
            for k, d in host.items():
                if isinstance(d, YolopipeError):
                    results[encoded[k]] = d
                else:
                    frames.append((encoded[k], d))  # decoded by OpenCV: packed as a frame
            if not frames and not gpu:
                return PipelineRun(results, {"decode_ms": (time.perf_counter() - t_start) * 1e3})
            plan = plan_batch(slot.staging.header_bytes, self.size, frames,
                              [(encoded[k], *decoded_size(h), decoder.layout) for k, h in gpu])
            frames = None  # the plan holds them
            if plan.end - slot.staging.header_bytes > slot.staging.capacity:
                self._grow(slot, plan.end - slot.staging.header_bytes)
            if gpu:
                base = slot.staging.dev.data_ptr()
                with self._torch.cuda.stream(decoder.stream):  # unwritten bytes are zeros, never a past image
                    slot.staging.dev[plan.device_start : plan.end].zero_()
                answers = decoder.decode_into([datas[k] for k, _ in gpu], [h for _, h in gpu],
                                              [base + off for off in plan.device_offsets])
                self._settle(slot, plan, answers, decoder, results)
                slot.decoded.record(decoder.stream)
                if marks is not None:
                    marks.record("decode", True, decoder.stream)
            waits_decoder = bool(gpu)
            datas = gpu = None
            if not plan.placed:
                return PipelineRun(results, {"decode_ms": (time.perf_counter() - t_start) * 1e3})
            bucket = self._bucket_to_run(slot, len(plan))
        t_decoded = time.perf_counter()
        timings["decode_ms"] = (t_decoded - t_start) * 1e3

        # 2. the host half of the staging, the NMS parameters, the graph.
        write_header(slot.staging.host_params, plan, bucket)
        copy_frames(slot.staging.host_np, plan.frame_copies, self._pool().map, self.host_threads)
        return self._launch(slot, plan.placed, plan.host_end, bucket, waits_decoder, params, profile,
                            timeline=timeline, marks=marks, timings=timings, results=results, t_start=t_start,
                            t_packing=t_decoded)

    def _run_nv12(self, slot: BatchSlot, images: Sequence[PipelineInput], params: DetectParams, profile: bool):
        t_start = time.perf_counter()
        results: list[Any] = [None] * len(images)
        plan = nv12_input.plan_frames(images, self.device, slot.staging.header_bytes, self.max_batch, self.size,
                                      results)
        if not plan.placed:
            return PipelineRun(results, {})
        if plan.end - slot.staging.header_bytes > slot.staging.capacity:
            self._grow(slot, plan.end - slot.staging.header_bytes)
        bucket = self._bucket_to_run(slot, len(plan), nv12=True)
        with self._torch.cuda.device(self.device):
            nv12_input.stage(slot.staging, plan, bucket, self.copy_stream)  # device to device, then "decoded"
            slot.decoded.record(self.copy_stream)
        t_copied = time.perf_counter()
        return self._launch(slot, plan.placed, plan.host_end, bucket, True, params, profile, nv12=True,
                            results=results, timings={"copy_ms": (t_copied - t_start) * 1e3}, t_start=t_start,
                            t_packing=t_copied)

    def _launch(self, slot: BatchSlot, placed: list, host_end: int, bucket: int, waits_decoder: bool,
                params: DetectParams, profile: bool, *, nv12: bool = False, timeline: Timeline | None = None,
                marks: Any = None, timings: dict[str, float], results: list[Any], t_start: float, t_packing: float
                ) -> PipelineRun:
        """The staging is ready (``placed[j]``: batch position ``j``'s result index and letterbox
        first): NMS parameters, the graph, upload, launch, wait, rows per image."""
        self._set_nms_params(slot, params)
        captured = slot.graphs.get(graph_key(bucket, nv12))
        if captured is None or (profile and not captured.stage_graphs):
            captured = self._capture_while_shared(slot, bucket, profile, nv12)
        timings["pack_ms"] = (time.perf_counter() - t_packing) * 1e3

        # 3-4. upload and graph launch, then wait for the slot's done event.
        if profile:
            timings.update(self.dispatcher.profiled(slot, captured, host_end, waits_decoder))
            path = "torch"
        else:
            path = self.dispatcher.submit(slot, captured, host_end, waits_decoder, marks, timings)
            t_enqueued = time.perf_counter()
            self.dispatcher.wait(slot, path)
            timings["wait_ms"] = (time.perf_counter() - t_enqueued) * 1e3
        t_done = time.perf_counter()

        # 5. rows per image.
        counts, rows = slot.results.counts, slot.results.rows
        for j, (i, lb, _, _) in enumerate(placed):
            results[i] = (rows[j, : int(counts[j])].copy(), lb)
        t_end = time.perf_counter()
        if marks is not None and timeline is not None:
            timeline.finish(marks)
        timings.update(unpack_ms=(t_end - t_done) * 1e3, total_ms=(t_end - t_start) * 1e3, batch=float(len(placed)),
                       bucket=float(bucket), slot=float(slot.index), raw_launch=1.0 if path == "driver" else 0.0)
        self.last_launch_path = path
        return PipelineRun(results, timings)

    def _cpu_decode(self, jpegs: list[EncodedImage]) -> list:
        """``decode="opencv"``: OpenCV's frames of ``jpegs`` (their headers already read), or errors."""
        def one(image: EncodedImage) -> Any:
            return cpu_decode(image.data, image.header, max_pixels=self.max_pixels)

        if len(jpegs) == 1:
            return [one(jpegs[0])]
        return list(self._pool().map(one, jpegs))

    def _settle(self, slot: BatchSlot, plan, answers: list, decoder: GpuJpegDecoder, results) -> None:
        """Each JPEG joins the batch only as the decoder reported it decoded in place, or as
        OpenCV's frame of it (through the pinned staging, H2D on the decoder's stream); any other
        answer is its error in ``results``, and its place is read by nothing."""
        from app.gpu.driver import copy_host_to_device, cuda_driver

        uploads, errors = settle_decoded(plan, answers, slot.staging.host_np, self.size)
        for i, err in errors.items():
            results[i] = err
        if uploads:
            dev, host = slot.staging.dev.data_ptr(), slot.staging.host.data_ptr()
            copy_host_to_device(cuda_driver(), [(dev + off, host + off, n) for off, n in uploads],
                                decoder.stream.cuda_stream)

    def _grow(self, slot: BatchSlot, needed: int) -> None:
        slot.grow(needed)
        self.dispatcher.attach(slot)

    def _set_nms_params(self, slot: BatchSlot, params: DetectParams) -> None:
        key = (params.conf, params.iou, params.max_det, params.classes, params.agnostic)
        if key != slot.nms_params_key:  # device params persist: rewrite only on change
            with self._numba_device():
                slot.nms.set_params(conf=params.conf, iou=params.iou, max_det=params.max_det,
                                    classes=params.classes, agnostic=params.agnostic, stream=self.compute.numba)
            slot.nms_params_key = key

    def _capture_while_shared(self, slot: BatchSlot, bucket: int, profile: bool, nv12: bool = False) -> CapturedBatch:
        """Capture from inside a run: give up the share, capture alone, take the share back."""
        self._gate.release_shared()
        try:
            with self._exclusive():
                if self._closed:
                    raise DeviceError("the GPU pipeline was closed")
                return self.graphs.captured(slot, bucket, profile=profile, raw_exec=slot.dispatch is not None,
                                            nv12=nv12)
        finally:
            self._gate.acquire_shared()

    # ----------------------------------------------------------------------- lifetime
    def release_memory(self) -> None:
        """Give back what a burst grew: staging grown for large images goes back to its first
        size (those slots' graphs are captured again on their next use), then torch's cached
        device blocks and pinned host blocks are freed. Waits for the batches in flight."""
        torch = self._torch
        with self._exclusive():
            if self._closed:
                return
            grown = [slot for slot in self.slots if slot.staging.capacity > self._first_staging]
            torch.cuda.synchronize(self.device)
            for slot in grown:  # freed before the caches are emptied: a new buffer must not split a freed one
                slot.graphs.free()
                slot.staging.free()
            torch.cuda.empty_cache()
            host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks
            if host_empty_cache is not None:
                host_empty_cache()
            for slot in grown:
                slot.resize_staging(self._first_staging)
                self.dispatcher.attach(slot)

    def close(self) -> None:
        """Free every device resource (idempotent), then the engine."""
        if self._closed:
            return
        self._closed = True
        with self._gate.exclusive():  # waits for the batches in flight
            for slot in self.slots:
                slot.free()
            for decoder in self._decoders.values():
                if decoder is not None:
                    with contextlib.suppress(Exception):
                        decoder.close()
            self._decoders.clear()
            self.inputs.free()
            self.compute.free()
            self.engine.close()
            if self._host_pool is not None:
                self._host_pool.shutdown(wait=True)
                self._host_pool = None
            self.dispatcher.close()
            self.graphs.close()

    def __enter__(self) -> GpuPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

