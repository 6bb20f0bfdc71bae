"""The GPU request path: images → boxes, with the stages of consecutive batches overlapped.

One batch: (1) **decode** (``app.gpu.decode``): each JPEG decoded on the GPU straight into its
planned place in the slot's device staging (nvImageCodec by default), or by OpenCV in the host
threads; a JPEG joins the batch only as its decoder reported it decoded; (2) **staging**
(``app.gpu.pack``): the params header and the frames into the slot's pinned staging; (3)
**upload**: one H2D copy on the copy stream; (4) **graph** (``app.gpu.capture``): letterbox →
engine → NMS → D2H of the rows, one launch on the compute stream; (5) **unpack**
(``app.gpu.slot``): rows per image. Device NV12 frames (NVDEC's) take steps 1-2 from
``app.gpu.nv12_input``: device-to-device copies into the staging, then the bucket's NV12 graph.

``run`` is thread-safe and takes one of ``in_flight`` batch slots for the whole batch, so while
batch N's graph runs, batch N+1 is decoded and uploaded into its own slot and batch N−1's rows
are unpacked from theirs (``app.pipeline.overlap`` drives a stream of batches that way). Every
wait releases the GIL. Graph launches go straight through the CUDA driver
(``app.gpu.driver.RawDispatch``; ``CUDAGraph.replay()`` if that is unavailable). A batch holds
its device's gate shared, a capture holds it exclusively (``app.gpu.device.CudaDevice``, which
the runtime hands in: no CUDA call from any other thread on the device meanwhile, NVDEC readers
included), and runs on the one capture thread of ``app.gpu.capture`` (the same kernels in
every graph of a bucket: the same answer in any slot). The pipeline makes its device current
only for the blocks that need it (``CudaDevice.current``), never for its caller's thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.config import MAX_DET, gpu_host_threads
from app.contracts import (
    DetectParams,
    DeviceNv12,
    Diagnostics,
    EncodedImage,
    PipelineInput,
    PipelineRun,
    RunFacts,
    RunShape,
    StageTimes,
    measure_once,
)
from app.engine_contracts import DeviceEngine
from app.errors import DeviceError, InvalidParameter, YolopipeError
from app.gpu import nv12_input, pack
from app.gpu.bare import engine_alone
from app.gpu.capture import GraphBuilder, graph_key, key_parts
from app.gpu.decode import Decoders, split_jpegs
from app.gpu.decoded import decoded_size
from app.gpu.device import CudaDevice
from app.gpu.dispatch import Dispatcher
from app.gpu.memory import CapturedBatch, InputBuffer, StreamPair
from app.gpu.slot import BatchSlot, shrink_staging
from app.gpu.timeline import Timeline
from app.types import ModelMeta


class GpuPipeline:
    """Implements ``app.contracts.Pipeline`` for a ``DeviceEngine`` (torch-cuda, TensorRT).

    ``shape``: the run shape ``app.runtime`` clamped to the engine: ``max_batch``, ``in_flight``
    (batches in flight at once, a ``BatchSlot`` each), ``decode`` (``gpu`` | ``nvimgcodec`` |
    ``nvjpeg`` | ``opencv``, ``app.gpu.decode``: the runs' decoder unless a run names its own)
    and ``max_pixels`` (the limit OpenCV's decodes are held to) are read from it. ``cuda``: the
    device it runs on, whose gate it holds (the process's one of that device: NVDEC readers
    share it). ``host_threads``: the pool that packs frames and decodes with OpenCV;
    ``raw_launch``: dispatch through the CUDA driver directly when possible. The pipeline owns
    ``engine`` once built (``close`` closes it); a constructor that fails frees what it took
    and leaves the engine to the caller.
    """

    decodes_jpeg = True
    takes_nv12 = True
    letterbox = "square"  # its kernels write the imgsz square (rect inputs: issue 47's GPU part)

    def __init__(
        self,
        engine: DeviceEngine,
        meta: ModelMeta,
        shape: RunShape,
        cuda: CudaDevice,
        *,
        max_det: int = MAX_DET,
        staging_bytes: int | None = None,
        host_threads: int | None = None,
        raw_launch: bool = True,
        pad_to_captured: bool = False,
    ) -> None:
        import torch

        if shape.max_batch > engine.max_batch:  # its buffers are the engine's size: a larger batch overruns them
            raise InvalidParameter(f"max_batch {shape.max_batch} is over the engine's max_batch {engine.max_batch}")
        self._torch = torch
        self.engine = engine
        self.backend = engine.name
        self.precision = engine.precision
        self.meta = meta
        self.max_batch = shape.max_batch
        self.in_flight = shape.in_flight
        self.max_pixels = shape.max_pixels
        self.cuda = cuda
        self.device = cuda.index
        self.max_det = int(max_det)
        self.size = int(meta.imgsz)
        self.buckets = tuple(pack.bucket_sizes(self.max_batch))
        self.host_threads = int(host_threads or gpu_host_threads())
        self.pad_to_captured = pad_to_captured  # see _bucket_to_run
        self._closed = False
        self._host_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._decoders = Decoders(self.device, self.host_threads)
        self._decode = shape.decode  # a run's decoder unless it names its own
        self._timeline: Timeline | None = None

        # The device current for the set-up only (torch's and Numba's allocations), not after it
        # on the caller's thread; a step that fails frees what the steps before it took.
        with cuda.current(), contextlib.ExitStack() as undo:
            self.compute = StreamPair(self.device)
            undo.callback(self.compute.free)
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self.inputs = InputBuffer(self.max_batch, self.size, engine.input_dtype, self.device)
            undo.callback(self.inputs.free)
            staging_bytes = staging_bytes or self.max_batch * self.size * self.size * 3
            self.slots = []
            for i in range(self.in_flight):
                self.slots.append(BatchSlot(i, max_batch=self.max_batch, max_det=self.max_det, meta=meta,
                                            device=self.device, staging_bytes=staging_bytes))
                undo.callback(self.slots[-1].free)
            self.graphs = GraphBuilder(engine, self.inputs, self.compute, self.slots, context=cuda.current)
            undo.callback(self.graphs.close)
            self._first_staging = self.slots[0].staging.capacity  # release_memory shrinks grown staging back to it
            self._free_slots: queue.SimpleQueue[BatchSlot] = queue.SimpleQueue()
            for slot in self.slots:
                self._free_slots.put(slot)
            undo.callback(self._decoders.close)
            self._decoders.get(self._decode)  # made now, so that a missing library shows at start-up
            self.dispatcher = Dispatcher(self.device, self.compute, self.copy_stream, raw_launch=raw_launch)
            undo.callback(self.dispatcher.close)
            self.dispatcher.setup(self.slots)
            undo.pop_all()  # built: close() frees it all from now on

    # ------------------------------------------------------------------------- set-up
    @contextlib.contextmanager
    def _exclusive(self):
        """Nothing else runs: for captures (they call ``engine.forward``), ``release_memory``, ``diagnose``."""
        with self.cuda.exclusive(), self.cuda.current():
            yield

    def _pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._host_pool is None:
                self._host_pool = ThreadPoolExecutor(max_workers=self.host_threads, thread_name_prefix="yolopipe-host")
            return self._host_pool

    def _bucket_to_run(self, slot: BatchSlot, n: int, nv12: bool = False) -> int:
        """The bucket ``n`` images run in on ``slot``: the smallest that takes them, its graph
        captured now if missing; with ``pad_to_captured``, the smallest that takes them among
        those already captured there, if any, so that a bucket a run needs once (a folder's last
        batch) or while the service is still capturing the others costs no capture."""
        captured = (lambda b: slot.graphs.get(graph_key(b, nv12)) is not None) if self.pad_to_captured else None
        return pack.bucket_to_run(self.buckets, n, captured)

    def warmup(self, batches: Sequence[int] | None = None, *, nv12: bool = False,
               frame_size: tuple[int, int] | None = None) -> None:
        """Capture the graphs of the buckets of ``batches`` (all by default) on every slot now;
        ``nv12``: those of device NV12 batches instead of images'. ``frame_size``: the (height,
        width) of NV12 frames to come: each slot first makes room for the largest bucket of them
        (its dropped graphs captured again), so that no batch grows it, and captures, while NVDEC
        readers are busy. When all of that is done already, nothing waits for the gate."""
        if self._closed:
            raise DeviceError("the GPU pipeline was closed")
        sizes = sorted({pack.bucket_for(self.buckets, b) for b in (batches or self.buckets)})
        header, keys = self.slots[0].staging.header_bytes, [graph_key(b, nv12) for b in sizes]
        room = nv12_input.staging_for(header, self.max_batch, sizes[-1], *frame_size) if frame_size else 0
        if all(slot.has(room, keys) for slot in self.slots):
            return
        with self._exclusive():
            for slot in self.slots:
                dropped = slot.make_room(room)
                if dropped:
                    self.dispatcher.attach(slot)
                for key in dict.fromkeys([*dropped, *keys]):
                    batch, is_nv12 = key_parts(key)
                    self.graphs.captured(slot, batch, profile=False, raw_exec=slot.dispatch is not None, nv12=is_nv12)

    # ---------------------------------------------------------------------- diagnostics
    def diagnose(self, *, decode: str | None = None,
                 profile: tuple[Sequence[PipelineInput], DetectParams] | None = None,
                 bare: Any = None, measure: Callable[[Callable[[], object]], list[float]] = measure_once,
                 timeline: bool = False) -> Diagnostics:
        """``Pipeline.diagnose``. ``profile``: one run on the profiling path (each stage its own
        graph, CUDA events between them); ``bare``: the engine alone in a graph of its own, the
        device held alone meanwhile (``app.gpu.bare``); ``timeline``: CUDA events per stage of
        every batch (``app.gpu.timeline``) until the returned timeline is closed."""
        profiled = self._run_batch(profile[0], profile[1], decode, profile=True) if profile is not None else None
        alone = None
        if bare is not None:
            with self._exclusive():
                alone = engine_alone(self.engine, bare, measure)
        recorder = None
        if timeline:
            recorder = self._timeline = Timeline(self.compute.torch, on_close=self._timeline_closed)
        engine = self.engine
        return Diagnostics(decoder=self._decoders.name_of(decode or self._decode), compiled=engine.compiled,
                           compiler=engine.compiler, batch_invariant=engine.batch_invariant,
                           launch_error=self.dispatcher.raw_launch_error, profiled=profiled, bare=alone,
                           timeline=recorder)

    def _timeline_closed(self, timeline: Timeline) -> None:
        if self._timeline is timeline:
            self._timeline = None

    # --------------------------------------------------------------------------- run
    def run(self, images: Sequence[PipelineInput], params: DetectParams, *, decode: str | None = None) -> PipelineRun:
        """One batch; thread-safe: up to ``in_flight`` calls overlap, more wait for a slot."""
        return self._run_batch(images, params, decode)

    def _run_batch(self, images: Sequence[PipelineInput], params: DetectParams, decode: str | None,
                   profile: bool = False) -> PipelineRun:
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
            with self.cuda.shared():
                if self._closed:
                    raise DeviceError("the GPU pipeline was closed")
                return self._run(slot, images, params, decode or self._decode, profile)
        except YolopipeError:
            raise
        except Exception as exc:  # a CUDA failure: say which, keep the type family
            raise DeviceError(f"GPU pipeline failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._free_slots.put(slot)

    def _run(self, slot: BatchSlot, images: Sequence[PipelineInput], params: DetectParams, decode: str,
             profile: bool) -> PipelineRun:
        if any(isinstance(x, DeviceNv12) for x in images):
            return self._run_nv12(slot, images, params, profile)
        t_start = time.perf_counter()
        results: list[Any] = [None] * len(images)
        encoded = [i for i, x in enumerate(images) if isinstance(x, EncodedImage)]  # positions of the JPEGs
        frames = pack.checked_frames(images, set(encoded), results)
        decoder = self._decoders.get(decode) if encoded else None
        timeline = self._timeline
        marks = timeline.begin(len(images), ("decode", "upload", "compute") if decoder else ("upload", "compute")) \
            if timeline is not None else None

        # 1-2. decode and plan; JPEGs decoded on the GPU go straight into their place (under the decoder's lock).
        with decoder.lock if decoder is not None else contextlib.nullcontext():
            if marks is not None and decoder is not None:
                marks.record("decode", False, decoder.stream)
            jpegs: list[EncodedImage] = [images[i] for i in encoded]  # type: ignore[misc]
            gpu, host = split_jpegs(decoder, jpegs, self.max_pixels, self._pool)
            for k, d in host.items():
                if isinstance(d, YolopipeError):
                    results[encoded[k]] = d
                else:
                    frames.append((encoded[k], d))  # decoded by OpenCV: packed as a frame
            if not frames and not gpu:
                return PipelineRun(results, StageTimes(decode_ms=(time.perf_counter() - t_start) * 1e3))
            plan = pack.plan_batch(slot.staging.header_bytes, self.size, frames,
                                   [(encoded[k], *decoded_size(h), decoder.layout) for k, h in gpu])
            frames = None  # the plan holds them
            if plan.end - slot.staging.header_bytes > slot.staging.capacity:
                self._grow(slot, plan.end - slot.staging.header_bytes)
            if gpu:
                base = slot.staging.dev.data_ptr()
                with self._torch.cuda.stream(decoder.stream):  # unwritten bytes are zeros, never a past image
                    slot.staging.dev[plan.device_start : plan.end].zero_()
                answers = decoder.decode_into([jpegs[k].data for k, _ in gpu], [h for _, h in gpu],
                                              [base + off for off in plan.device_offsets])
                pack.settle_and_upload(slot.staging, plan, answers, decoder.stream, self.size, results)
                slot.decoded.record(decoder.stream)
                if marks is not None:
                    marks.record("decode", True, decoder.stream)
            waits_decoder = bool(gpu)
            gpu = None
            if not plan.placed:
                return PipelineRun(results, StageTimes(decode_ms=(time.perf_counter() - t_start) * 1e3))
            bucket = self._bucket_to_run(slot, len(plan))
        t_decoded = time.perf_counter()

        # 2. the host half of the staging, the NMS parameters, the graph.
        pack.write_header(slot.staging.host_params, plan, bucket)
        pack.copy_frames(slot.staging.host_np, plan.frame_copies, self._pool().map, self.host_threads)
        return self._launch(slot, plan.placed, plan.host_end, bucket, waits_decoder, params, profile,
                            timeline=timeline, marks=marks, results=results, t_start=t_start, t_decoded=t_decoded)

    def _run_nv12(self, slot: BatchSlot, images: Sequence[PipelineInput], params: DetectParams, profile: bool):
        t_start = time.perf_counter()
        results: list[Any] = [None] * len(images)
        plan = nv12_input.plan_frames(images, self.device, slot.staging.header_bytes, self.max_batch, self.size,
                                      results)
        if not plan.placed:
            return PipelineRun(results)
        if plan.end - slot.staging.header_bytes > slot.staging.capacity:
            self._grow(slot, plan.end - slot.staging.header_bytes)
        bucket = self._bucket_to_run(slot, len(plan), nv12=True)
        with self._torch.cuda.device(self.device):
            nv12_input.stage(slot.staging, plan, bucket, self.copy_stream)  # device to device, then "decoded"
            slot.decoded.record(self.copy_stream)
        return self._launch(slot, plan.placed, plan.host_end, bucket, True, params, profile, nv12=True,
                            results=results, t_start=t_start, t_decoded=time.perf_counter())

    def _launch(self, slot: BatchSlot, placed: list, host_end: int, bucket: int, waits_decoder: bool,
                params: DetectParams, profile: bool, *, nv12: bool = False, timeline: Timeline | None = None,
                marks: Any = None, results: list[Any], t_start: float, t_decoded: float) -> PipelineRun:
        """The staging is ready (``placed[j]``: batch position ``j``'s result index and letterbox
        first): NMS parameters, the graph, upload, launch, wait, rows per image."""
        slot.set_nms_params(params, self.compute.numba, self.cuda.numba)
        captured = slot.graphs.get(graph_key(bucket, nv12))
        if captured is None or (profile and not captured.stage_graphs):
            captured = self._capture_while_shared(slot, bucket, profile, nv12)
        t_packed = time.perf_counter()

        # 3-4. upload and graph launch, then wait for the slot's done event.
        launch: dict[str, float] = {}  # the launch's host costs (RunFacts)
        device_ms: dict[str, float] = {}
        if profile:
            for key, value in self.dispatcher.profiled(slot, captured, host_end, waits_decoder).items():
                if key.startswith("gpu_"):
                    device_ms[key.removeprefix("gpu_").removesuffix("_ms")] = value
                else:
                    launch[key] = value
            path = "torch"
        else:
            path = self.dispatcher.submit(slot, captured, host_end, waits_decoder, marks, launch)
            self.dispatcher.wait(slot, path)
        t_done = time.perf_counter()

        slot.unpack(placed, results)  # 5. rows per image
        t_end = time.perf_counter()
        if marks is not None and timeline is not None:
            timeline.finish(marks)
        times = StageTimes(decode_ms=(t_decoded - t_start) * 1e3, preprocess_ms=(t_packed - t_decoded) * 1e3,
                           infer_ms=(t_done - t_packed) * 1e3, postprocess_ms=(t_end - t_done) * 1e3)
        facts = RunFacts(len(placed), bucket, slot.index, path, bool(launch.get("upload_on_compute")),
                         launch.get("upload_us", 0.0), launch.get("dispatch_us", 0.0), launch.get("launch_us", 0.0))
        return PipelineRun(results, times, facts, device_ms)

    def _grow(self, slot: BatchSlot, needed: int) -> None:
        slot.grow(needed)
        self.dispatcher.attach(slot)

    def _capture_while_shared(self, slot: BatchSlot, bucket: int, profile: bool, nv12: bool = False) -> CapturedBatch:
        """Capture from inside a run: give up the share, capture alone, take the share back."""
        with self.cuda.exclusive_from_shared(), self.cuda.current():
            if self._closed:
                raise DeviceError("the GPU pipeline was closed")
            return self.graphs.captured(slot, bucket, profile=profile, raw_exec=slot.dispatch is not None, nv12=nv12)

    # ----------------------------------------------------------------------- lifetime
    def release_memory(self) -> None:
        """Give back what a burst grew: staging grown for large images goes back to its first
        size (those slots' graphs are captured again on their next use), then torch's cached
        device blocks and pinned host blocks are freed. Waits for the batches in flight."""
        with self._exclusive():
            if self._closed:
                return
            shrink_staging(self.slots, self._first_staging, self.device, self.dispatcher.attach)

    def close(self) -> None:
        """Free every device resource (idempotent), then the engine."""
        if self._closed:
            return
        self._closed = True
        with self.cuda.exclusive():  # waits for the batches in flight
            for slot in self.slots:
                slot.free()
            self._decoders.close()
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

