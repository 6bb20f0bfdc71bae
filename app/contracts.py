"""The contracts every backend and both pipelines implement, and the data they pass.

A backend turns a preprocessed batch into the raw head output.

Two shapes, because where the data lives decides everything:

* ``HostBackend`` (ONNX Runtime): NumPy ``[B, 3, S, S]`` float32 in, NumPy ``[B, 4+nc, A]`` out.
  Preprocessing and NMS around it run on the CPU (``app.pipeline.cpu``).
* ``DeviceEngine`` (torch-cuda, TensorRT): a device tensor in, a device array out, enqueued on
  torch's current CUDA stream and capturable in a CUDA graph. Preprocessing and NMS around it
  run on the GPU (``app.pipeline.gpu``), and the output never leaves the device.

And one shape for the whole image→rows path, which the ``Detector`` drives: ``Pipeline``, whose
``run`` returns a ``PipelineRun`` (rows per image and that batch's own stage timings).
These are the whole contract: every attribute and method named here exists on every
implementation, so callers never probe for them.

Around them, the data every front end shares: ``EncodedImage`` (bytes with the header whoever
read them first parsed), ``RunShape`` (how a detector runs, clamped once where it is opened)
and ``DetectedBatch`` (what ``Detector.run`` answers for a batch, as arrays).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from app.config import CONF, IN_FLIGHT, IOU, MAX_DET, MAX_PIXELS, MAX_WAIT_MS, SERVE_MAX_BATCH, decoder_name
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


class HostBackend(Protocol):
    name: str  # "onnxruntime"
    precision: str  # "fp32" | "int8"

    def infer(self, batch: np.ndarray) -> np.ndarray:
        """``[B, 3, S, S]`` float32 RGB in [0, 1] → ``[B, 4 + nc, anchors]`` float32."""

    def release_memory(self) -> None:
        """Free what the backend keeps between batches; the next ``infer`` allocates again."""

    def close(self) -> None: ...


class DeviceEngine(Protocol):
    name: str  # "torch-cuda" | "tensorrt"
    precision: str  # "fp32" | "fp16" | "int8"
    input_dtype: str  # "float32" | "float16": what ``forward`` expects
    max_batch: int
    compiled: bool  # torch-cuda: running a torch.compile'd model; TensorRT: False (built ahead)

    def forward(self, images: Any) -> Any:
        """Enqueue the model on torch's current CUDA stream.

        ``images``: a contiguous CUDA tensor ``[B, 3, S, S]`` of ``input_dtype``, RGB in [0, 1].
        Returns an object with ``__cuda_array_interface__`` holding ``[B, 4 + nc, anchors]``
        (float16 or float32). No host sync, and after one warm-up call per batch size the
        addresses it reads and writes stay fixed, so the call can be captured in a CUDA graph.
        The pipeline calls it only while capturing, one call at a time, and replays the graphs
        on one stream, so one execution state serves every batch in flight.
        """

    def close(self) -> None: ...


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
    bytes to the decoder, so nothing on the way parses it again."""

    data: bytes
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

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.in_flight < 1 or self.max_pixels < 1 or self.max_wait_ms < 0:
            raise InvalidParameter(f"a run needs max_batch, in_flight and max_pixels >= 1 and max_wait_ms >= 0: {self}")
        object.__setattr__(self, "decode", decoder_name(self.decode))  # an old alias resolved, once
        object.__setattr__(self, "video_decode", decoder_name(self.video_decode, video=True))


@dataclass
class DetectedBatch:
    """What ``Detector.run`` answers for a batch of images, as arrays, in the batch's order.

    Per image its source ``widths``/``heights`` and ``counts`` of rows (both 0 for an image in
    ``errors``, its position → the error that stopped it); ``rows``: every ok image's rows one
    image after another, ``[sum(counts), 6]`` float32 (x1, y1, x2, y2 in source pixels, score,
    class); ``timings``: the stage times of the pipeline runs that made it (summed)."""

    widths: np.ndarray  # [n] int64
    heights: np.ndarray  # [n] int64
    counts: np.ndarray  # [n] int64
    rows: np.ndarray  # [sum(counts), 6] float32
    errors: dict[int, YolopipeError] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.counts)

    @classmethod
    def failed(cls, errors: Sequence[YolopipeError], timings: dict[str, float] | None = None) -> DetectedBatch:
        """A batch whose every image failed, each with its error."""
        zeros = np.zeros(len(errors), np.int64)
        return cls(zeros, zeros.copy(), zeros.copy(), np.zeros((0, 6), np.float32), dict(enumerate(errors)),
                   timings or {})

    @classmethod
    def concat(cls, parts: Sequence[DetectedBatch]) -> DetectedBatch:
        """The images of ``parts``, one part after another (timings: the first part's)."""
        if not parts:
            return cls.failed([])
        errors: dict[int, YolopipeError] = {}
        start = 0
        for part in parts:
            errors.update((start + i, e) for i, e in part.errors.items())
            start += len(part)
        return cls(np.concatenate([p.widths for p in parts]), np.concatenate([p.heights for p in parts]),
                   np.concatenate([p.counts for p in parts]), np.concatenate([p.rows for p in parts]), errors,
                   dict(parts[0].timings))

    def take(self, positions: Sequence[int]) -> DetectedBatch:
        """The images at ``positions``, in that order (timings: this batch's)."""
        positions = np.asarray(positions, np.int64)
        starts = np.cumsum(self.counts) - self.counts
        taken = self.counts[positions]
        first = np.repeat(starts[positions] - (np.cumsum(taken) - taken), taken)
        rows = self.rows[first + np.arange(int(taken.sum()))]
        errors = {k: self.errors[p] for k, p in enumerate(positions.tolist()) if p in self.errors}
        return DetectedBatch(self.widths[positions], self.heights[positions], taken, rows, errors, dict(self.timings))

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
    """What one ``Pipeline.run`` gives back: per image its rows or its own error, in order, and
    the stage times of this batch (``*_ms``, ``*_us``), so no caller reads another batch's."""

    images: list[ImageRows | YolopipeError]
    timings: dict[str, float] = field(default_factory=dict)


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
    device: int | None  # the CUDA device a GPU pipeline runs on (its NV12 frames' too); None on the CPU

    def run(self, images: Sequence[PipelineInput], params: DetectParams) -> PipelineRun:
        """At most ``max_batch`` images; a per-image error (e.g. a corrupt JPEG) stands in its place.
        Safe to call from ``in_flight`` threads at once."""

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
