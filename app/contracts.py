"""The contracts every backend and both pipelines implement, and the data they pass.

A backend turns a preprocessed batch into the raw head output, in one of two shapes
(``app.engine_contracts``: ``HostBackend``, ``DeviceEngine``).

One shape serves the whole image→rows path, which the ``Detector`` drives: ``Pipeline``, whose
``run`` returns a ``PipelineRun`` (rows per image, that batch's own ``StageTimes`` and its
``RunFacts``) and whose ``diagnose`` answers ``Diagnostics``. These are the whole contract: every
attribute and method named here exists on every implementation, so callers never probe for them.

Around them, the data every front end shares: ``EncodedImage`` (bytes with the header whoever
read them first parsed), ``RunShape`` (how a detector runs, clamped once where it is opened)
and ``DetectedBatch`` (what ``Detector.run`` answers for a batch, as arrays).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from app.config import (
    CONF,
    IN_FLIGHT,
    IOU,
    LETTERBOXES,
    MAX_DET,
    MAX_PIXELS,
    MAX_WAIT_MS,
    SERVE_MAX_BATCH,
    check_choice,
    decoder_name,
)
from app.errors import InvalidParameter, YolopipeError
from app.imaging.headers import ImageHeader
from app.types import Detections, Letterbox, ModelMeta


@dataclass(frozen=True)
class DetectParams:
    """Per-request detection parameters (checked by ``make_params``)."""

    conf: float = CONF
    iou: float = IOU
    max_det: int = MAX_DET
    classes: tuple[int, ...] | None = None
    agnostic: bool = False


def make_params(
    conf: float = CONF,
    iou: float = IOU,
    max_det: int = MAX_DET,
    classes: Sequence[int] | None = None,
    agnostic: bool = False,
    *,
    num_classes: int | None = None,
) -> DetectParams:
    """Validated ``DetectParams``; ``InvalidParameter`` names the offending value."""
    if not 0.0 <= conf <= 1.0:
        raise InvalidParameter(f"conf must be within [0, 1], got {conf}")
    if not 0.0 <= iou <= 1.0:
        raise InvalidParameter(f"iou must be within [0, 1], got {iou}")
    if not 1 <= max_det <= MAX_DET:
        raise InvalidParameter(f"max_det must be within [1, {MAX_DET}], got {max_det}")
    if classes is not None:
        classes = tuple(int(c) for c in classes)
        bad = [c for c in classes if c < 0 or (num_classes is not None and c >= num_classes)]
        if bad:
            raise InvalidParameter(f"unknown class ids {bad}; this model has classes 0..{(num_classes or 1) - 1}")
    return DetectParams(float(conf), float(iou), int(max_det), classes, bool(agnostic))


@dataclass
class ImageResult:
    """One image's outcome: detections with the source size, or the error that stopped it (for
    callers that want an object per image; every JSON record comes from arrays, ``app.records``)."""

    width: int = 0
    height: int = 0
    detections: Detections | None = None
    error: YolopipeError | None = None


@dataclass(frozen=True)
class DeviceNv12:
    """One video frame in GPU memory, NV12 as NVDEC decodes it (``app.gpu.nvdec``).

    ``planes``: a torch ``uint8`` CUDA tensor ``[rows, cols]`` whose rows may be strided (the
    row stride is the pitch): its first ``rows * 2 / 3`` rows are the Y plane, the rest the
    interleaved UV plane; the picture is its top-left ``height × width``. It must be complete on
    the device when passed, and left untouched until ``run`` returns (the pipeline copies it).
    ``colorspace`` (FFmpeg's AVColorSpace code of the stream's colour matrix; 2: unspecified) and
    ``full_range`` say how its YUV converts to RGB, as OpenCV's decode of the stream converts it
    (``app.imaging.yuv``).
    """

    planes: Any
    height: int
    width: int
    colorspace: int = 2
    full_range: bool = False


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image's encoded bytes and the header whoever first read them parsed and checked
    (``app.imaging.check.check_image``: format, size, decode memory). The header travels with the
    bytes to the decoder, so nothing on the way parses it again. ``data``: the bytes, or a uint8
    array viewing them where they lie (the inference worker's view of an HTTP worker's ring,
    valid until the image is answered)."""

    data: bytes | np.ndarray
    header: ImageHeader


# One image as a pipeline takes it: decoded BGR uint8 HWC pixels, a JPEG for a pipeline that
# decodes JPEG itself (``Pipeline.decodes_jpeg``), or a device NV12 frame for one that takes them
# (``Pipeline.takes_nv12``; a batch holds only those, or none).
PipelineInput = np.ndarray | EncodedImage | DeviceNv12


@dataclass(frozen=True)
class RunShape:
    """How a detector runs: clamped once, where it is opened (``app.runtime.open_model_dir``), to
    what its pipeline takes, and carried by it (``Detector.shape``). The pipeline is built from
    the clamped shape; every front end (the service's batcher, folders, videos, streams, Ray)
    reads it; none clamps again."""

    max_batch: int = SERVE_MAX_BATCH  # images per pipeline run
    in_flight: int = IN_FLIGHT  # batches in flight at once (each run from its own thread)
    decode: str = "gpu"  # JPEG decoder of a GPU pipeline (``app.config.DECODERS``)
    video_decode: str = "auto"  # decoder of videos and streams (``app.config.VIDEO_DECODERS``)
    max_pixels: int = MAX_PIXELS  # per image or frame, read from its header before it is decoded
    max_wait_ms: float = MAX_WAIT_MS  # longest wait for a batch to fill (batcher, stream runners)
    # where an image is placed in the model input (``app.config.LETTERBOXES``): rect, Ultralytics'
    # ``model.predict(source)`` default (each image at the smallest multiple of the stride holding
    # it: a run holds images of one input size); square, imgsz × imgsz (``--square``)
    letterbox: str = "rect"

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.in_flight < 1 or self.max_pixels < 1 or self.max_wait_ms < 0:
            raise InvalidParameter(f"a run needs max_batch, in_flight and max_pixels >= 1 and max_wait_ms >= 0: {self}")
        check_choice("letterbox", self.letterbox, LETTERBOXES)
        object.__setattr__(self, "decode", decoder_name(self.decode))  # an old alias resolved, once
        object.__setattr__(self, "video_decode", decoder_name(self.video_decode, video=True))


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Milliseconds per stage of a pipeline run, or of several runs summed (``+``): the same
    stages on every pipeline, a stage a pipeline does not have counting 0. Only these are summed
    over a batch's runs, observed as latencies (``yolopipe_stage_latency_seconds``) and sent in
    ``/v1``'s ``timings``; what a run was (its batch, bucket, slot) is in its ``RunFacts``."""

    # images decoded by the pipeline: JPEGs on the GPU (or by OpenCV in its threads), NV12 frames
    # copied in; 0 on the CPU pipeline, whose images come decoded
    decode_ms: float = 0.0
    # the batch made ready for the model on the host: letterbox and input tensor (CPU); the
    # staging packed, and the bucket's graphs captured where missing (GPU: the graph letterboxes)
    preprocess_ms: float = 0.0
    # the model: ONNX Runtime's run (CPU); the upload, the graph's launch (letterbox, engine, NMS,
    # rows to the host) and the wait for it (GPU)
    infer_ms: float = 0.0
    # NMS (CPU); the rows split per image (GPU)
    postprocess_ms: float = 0.0

    def __add__(self, other: StageTimes) -> StageTimes:
        return StageTimes(self.decode_ms + other.decode_ms, self.preprocess_ms + other.preprocess_ms,
                          self.infer_ms + other.infer_ms, self.postprocess_ms + other.postprocess_ms)

    def values(self) -> tuple[float, float, float, float]:
        """The stages' times in their order (what ``dataclasses.astuple`` gives, without its deep copy)."""
        return self.decode_ms, self.preprocess_ms, self.infer_ms, self.postprocess_ms

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What one pipeline run was, apart from how long its stages took: for diagnostics and
    benchmarks, never summed or observed as a latency."""

    batch: int  # images that reached the model
    bucket: int  # the batch size it ran as (padded up to; = batch where nothing is padded)
    slot: int = 0  # the batch slot it held (GPU, one per batch in flight); 0 on the CPU
    launch: str = ""  # GPU: "driver" (the CUDA driver directly) | "torch" (CUDAGraph.replay); "" on the CPU
    upload_on_compute: bool = False  # GPU: the batch was alone in flight, its upload on the compute stream
    # GPU: the host's cost of the launch (inside infer_ms): enqueueing the upload; the waits, the
    # graph launch and its done record; the launch and record alone
    upload_us: float = 0.0
    dispatch_us: float = 0.0
    launch_us: float = 0.0


@dataclass
class DetectedBatch:
    """What ``Detector.run`` answers for a batch of images, as arrays, in the batch's order.

    Per image its source ``widths``/``heights`` and ``counts`` of rows (both 0 for an image in
    ``errors``, its position → the error that stopped it); ``rows``: every ok image's rows one
    image after another, ``[sum(counts), 6]`` float32 (x1, y1, x2, y2 in source pixels, score,
    class); ``timings``: the stage times of the pipeline runs that made it (summed); ``runs``:
    each of those runs' facts, in order."""

    widths: np.ndarray  # [n] int64
    heights: np.ndarray  # [n] int64
    counts: np.ndarray  # [n] int64
    rows: np.ndarray  # [sum(counts), 6] float32
    errors: dict[int, YolopipeError] = field(default_factory=dict)
    timings: StageTimes = field(default_factory=StageTimes)
    runs: tuple[RunFacts, ...] = ()

    def __len__(self) -> int:
        return len(self.counts)

    @classmethod
    def failed(cls, errors: Sequence[YolopipeError]) -> DetectedBatch:
        """A batch whose every image failed, each with its error."""
        zeros = np.zeros(len(errors), np.int64)
        return cls(zeros, zeros.copy(), zeros.copy(), np.zeros((0, 6), np.float32), dict(enumerate(errors)))

    @classmethod
    def concat(cls, parts: Sequence[DetectedBatch]) -> DetectedBatch:
        """The images of ``parts``, one part after another (timings and runs: the first part's)."""
        if not parts:
            return cls.failed([])
        errors: dict[int, YolopipeError] = {}
        start = 0
        for part in parts:
            errors.update((start + i, e) for i, e in part.errors.items())
            start += len(part)
        return cls(np.concatenate([p.widths for p in parts]), np.concatenate([p.heights for p in parts]),
                   np.concatenate([p.counts for p in parts]), np.concatenate([p.rows for p in parts]), errors,
                   parts[0].timings, parts[0].runs)

    def take(self, positions: Sequence[int]) -> DetectedBatch:
        """The images at ``positions``, in that order (timings and runs: this batch's)."""
        positions = np.asarray(positions, np.int64)
        starts = np.cumsum(self.counts) - self.counts
        taken = self.counts[positions]
        first = np.repeat(starts[positions] - (np.cumsum(taken) - taken), taken)
        rows = self.rows[first + np.arange(int(taken.sum()))]
        errors = {k: self.errors[p] for k, p in enumerate(positions.tolist()) if p in self.errors}
        return DetectedBatch(self.widths[positions], self.heights[positions], taken, rows, errors, self.timings,
                             self.runs)

    def rows_of(self, i: int) -> np.ndarray:
        """Image ``i``'s rows ``[K, 6]`` (a view)."""
        start = int(self.counts[:i].sum())
        return self.rows[start : start + int(self.counts[i])]

    def detections(self, i: int) -> Detections | None:
        """Image ``i``'s detections, or None when it failed."""
        return None if i in self.errors else Detections.from_rows(self.rows_of(i))

    def result(self, i: int) -> ImageResult:
        if i in self.errors:
            return ImageResult(error=self.errors[i])
        return ImageResult(int(self.widths[i]), int(self.heights[i]), self.detections(i))

    def results(self) -> list[ImageResult]:
        """Per image an ``ImageResult`` (objects per image: for callers that want them, not the
        JSON writers)."""
        starts = np.cumsum(self.counts) - self.counts
        out = []
        for i, (w, h, start, n) in enumerate(zip(self.widths.tolist(), self.heights.tolist(), starts.tolist(),
                                                 self.counts.tolist())):
            error = self.errors.get(i)
            out.append(ImageResult(error=error) if error is not None else
                       ImageResult(w, h, Detections.from_rows(self.rows[start : start + n])))
        return out


# One image's NMS rows ``[K, 6]`` (x1, y1, x2, y2, score, class) in input pixels and where it was placed.
ImageRows = tuple[np.ndarray, Letterbox]


@dataclass
class PipelineRun:
    """What one ``Pipeline.run`` gives back: per image its rows or its own error, in order, this
    batch's stage times (no caller reads another batch's) and facts (None: no image reached the
    model), and on the profiling path only (``Pipeline.diagnose``) each device stage's own time."""

    images: list[ImageRows | YolopipeError]
    timings: StageTimes = field(default_factory=StageTimes)
    facts: RunFacts | None = None
    device_ms: dict[str, float] = field(default_factory=dict)  # h2d, preprocess, engine, nms, d2h, total


def measure_once(call: Callable[[], object]) -> list[float]:
    """``Pipeline.diagnose``'s default ``measure``: one call, its wall time (ms)."""
    t0 = time.perf_counter()
    call()
    return [(time.perf_counter() - t0) * 1e3]


@dataclass(frozen=True)
class BareRun:
    """The engine alone on an already letterboxed batch (``Pipeline.diagnose(bare=...)``): the
    wall time of each timed call (ms) and, on a GPU, each call's device time (CUDA events)."""

    times_ms: list[float]
    device_ms: list[float]


@dataclass(frozen=True)
class Diagnostics:
    """What a pipeline says about itself (``Pipeline.diagnose``), for benchmarks and checks: the
    same fields on every pipeline, each as far as it applies there."""

    decoder: str  # what decodes its JPEGs under the ``decode`` asked about: nvimgcodec | nvjpeg | opencv
    compiled: bool  # the engine runs a compiled model (torch-cuda's package or torch.compile)
    compiler: str  # what made the engine's kernels: aoti | inductor | eager (torch-cuda), tensorrt, onnxruntime
    batch_invariant: bool  # promised: an image gets the same answer in any batch (torch-cuda's package)
    launch_error: str | None  # why batches are not launched through the CUDA driver; None: they are
    profiled: PipelineRun | None = None  # with ``profile``: that run, on the profiling path (``device_ms``)
    bare: BareRun | None = None  # with ``bare``: the engine alone
    # with ``timeline``: an ``app.gpu.timeline.Timeline`` recording every batch until closed; None on the CPU
    timeline: Any = None


class Pipeline(Protocol):
    """Images → NMS rows ``[K, 6]`` (x1, y1, x2, y2, score, class) in input pixels, per image."""

    backend: str
    precision: str
    max_batch: int
    max_det: int  # the most rows per image ``run`` can return: the ceiling of a request's max_det
    in_flight: int  # ``run`` calls (each from its own thread) that overlap usefully; 1: serial
    buckets: tuple[int, ...]  # batch sizes a run is padded up to, each prepared by ``warmup``; (): none padded
    meta: ModelMeta
    decodes_jpeg: bool  # True: JPEGs (``EncodedImage``) may be passed and are decoded by the pipeline
    takes_nv12: bool  # True: ``DeviceNv12`` frames may be passed (a batch of them only)
    # where its runs place an image (``RunShape.letterbox``, as ``app.runtime`` clamped it): rect (a
    # run then holds images of one input size, ``Detector``'s runs) or square; a GPU pipeline's is
    # square (its kernels write the imgsz square; rect is issue 47's GPU part)
    letterbox: str
    # the CUDA device a GPU pipeline runs on (its NV12 frames' too), an ``app.gpu.device.CudaDevice``:
    # its index and the gate its NVDEC readers hold too; None on the CPU
    cuda: Any

    def run(self, images: Sequence[PipelineInput], params: DetectParams, *, decode: str | None = None) -> PipelineRun:
        """At most ``max_batch`` images, under a rect ``letterbox`` all of one input size (else
        ``InvalidParameter``); a per-image error (e.g. a corrupt JPEG) stands in its place.
        ``decode``: the JPEG decoder of this run (``RunShape.decode``; None: the one the pipeline
        was built with). Safe to call from ``in_flight`` threads at once."""

    def diagnose(self, *, decode: str | None = None,
                 profile: tuple[Sequence[PipelineInput], DetectParams] | None = None,
                 bare: np.ndarray | None = None, measure: Callable[[Callable[[], object]], list[float]] = measure_once,
                 timeline: bool = False) -> Diagnostics:
        """What the pipeline is and how it runs (``Diagnostics``); each keyword asks for more:
        ``decode``: the JPEG decoder asked about (None: the pipeline's own); ``profile``: one run
        of these images on the profiling path (stage by stage, with syncs); ``bare``: the engine
        alone on this letterboxed batch (``[B, 3, S, S]`` float32 RGB in [0, 1]), its calls timed
        by ``measure`` (the ms of each timed call); ``timeline``: record every batch's stages
        from now until the timeline is closed."""

    def warmup(self, batches: Sequence[int] | None = None, *, nv12: bool = False,
               frame_size: tuple[int, int] | None = None) -> None:
        """Do now the one-time work of these batch sizes (all by default), not on first use:
        the GPU pipeline captures their CUDA graphs (``nv12``: those of device NV12 batches,
        after making room for a batch of NV12 frames of ``frame_size``, height and width);
        a CPU pipeline has nothing to do."""

    def release_memory(self) -> None:
        """Give back what batches left cached (an idle server calls it after a burst): ONNX
        Runtime's arena, torch's cached GPU blocks, staging grown for large images. Safe to
        call at any time; the next ``run`` allocates (and on a GPU captures) again."""

    def close(self) -> None: ...
