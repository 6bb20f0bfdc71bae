"""The one detector path shared by every backend and every front end: images in, arrays out.

The service's batcher, ``predict`` on folders, videos and streams, and the Ray actor all call
``Detector.run`` (or ``run_prepared``, on items they prepared in threads of their own): a batch
of already-read images (``EncodedImage``, BGR arrays, ``DeviceNv12`` frames, or the error that
stands in for one) → a ``DetectedBatch``: per image its source size and its error or its rows,
in source pixels (``app.boxes.scale_boxes_stacked``), the batch's stage times and its runs'
facts. It decodes on the CPU what the pipeline does not decode itself, splits the batch into
runs the pipeline takes (``RunShape.max_batch``; under a rect letterbox one run per input size,
``input_size``, so that no image's answer depends on its batch-mates; device frames apart from
host ones), each with the shape's JPEG decoder (``RunShape.decode``), keeps up to
``RunShape.in_flight`` of them in flight (``app.pipeline.overlap``), and validates parameters.
``app.records`` writes the JSON of its answers. What the benchmarks and checks ask of the model
beyond that, they ask through one method, ``diagnose``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from app.boxes import scale_boxes_stacked
from app.contracts import (
    DetectedBatch,
    DetectParams,
    DeviceNv12,
    Diagnostics,
    EncodedImage,
    ImageResult,
    Pipeline,
    PipelineInput,
    PipelineRun,
    RunFacts,
    RunShape,
    StageTimes,
    make_params,
    measure_once,
)
from app.errors import InvalidParameter, YolopipeError
from app.imaging.check import check_image
from app.imaging.decode import decode_image
from app.imaging.headers import ImageHeader
from app.imaging.letterbox import input_size
from app.pipeline.overlap import run_overlapped
from app.types import ModelMeta

# What ``run`` takes per image: bytes are read (header checked) here; an error stands in for an
# image that could not be read, and comes back as that image's answer.
Item = EncodedImage | np.ndarray | DeviceNv12 | YolopipeError | bytes


class Detector:
    """Owns one pipeline (and through it the backend and every GPU resource), and the run shape
    it was opened with (``shape``: ``app.runtime`` clamps it to the pipeline, once). It is the
    model's whole face: front ends, the service and the benchmarks ask it, never its pipeline."""

    def __init__(self, pipeline: Pipeline, shape: RunShape | None = None, **changes: Any) -> None:
        """``shape``: by default the pipeline's own batch and in-flight limits and letterbox;
        ``changes``: fields of it to set (``video_decode="nvdec"``)."""
        shape = replace(shape or RunShape(max_batch=pipeline.max_batch, in_flight=pipeline.in_flight,
                                          letterbox=pipeline.letterbox), **changes)
        # A shape made for another pipeline (tests, a stand-in) could ask for runs this one cannot take.
        if shape.max_batch > pipeline.max_batch or shape.in_flight > pipeline.in_flight:
            raise InvalidParameter(f"run shape max_batch {shape.max_batch}, in_flight {shape.in_flight} is over the "
                                   f"{pipeline.backend} pipeline's {pipeline.max_batch}, {pipeline.in_flight}")
        if shape.letterbox != pipeline.letterbox:
            raise InvalidParameter(f"run shape letterbox {shape.letterbox} is not the {pipeline.backend} pipeline's "
                                   f"{pipeline.letterbox}")
        self.pipeline = pipeline  # app.pipeline's own: everyone else uses the methods below
        self.shape = shape

    def reshaped(self, **changes: Any) -> Detector:
        """A detector on this same pipeline with these fields of the shape changed
        (``video_decode="opencv"``; ``decode="opencv"``: its runs decode JPEG with OpenCV);
        closing either closes the pipeline."""
        return Detector(self.pipeline, self.shape, **changes)

    # --- facts -----------------------------------------------------------------------
    @property
    def meta(self) -> ModelMeta:
        return self.pipeline.meta

    @property
    def names(self) -> list[str]:
        return self.pipeline.meta.names

    @property
    def max_pixels(self) -> int:
        return self.shape.max_pixels

    @property
    def backend(self) -> str:
        return self.pipeline.backend

    @property
    def precision(self) -> str:
        return self.pipeline.precision

    @property
    def device(self) -> int | None:
        """The CUDA device the pipeline runs on (NVDEC's frames must be on it); None on the CPU."""
        return None if self.pipeline.cuda is None else self.pipeline.cuda.index

    @property
    def cuda(self) -> Any:
        """The pipeline's ``app.gpu.device.CudaDevice`` (None on the CPU): what an NVDEC reader
        of this detector's frames decodes on, holding its gate (``app.gpu.nvdec``)."""
        return self.pipeline.cuda

    @property
    def takes_nv12(self) -> bool:
        """Whether device NV12 frames (``DeviceNv12``, NVDEC's) may be passed."""
        return self.pipeline.takes_nv12

    @property
    def max_det(self) -> int:
        """The most rows per image a run can return: the ceiling of a request's max_det."""
        return self.pipeline.max_det

    @property
    def buckets(self) -> tuple[int, ...]:
        """The batch sizes a run is padded up to, each prepared by ``warmup``; (): none padded."""
        return self.pipeline.buckets

    def input_size(self, height: int, width: int) -> tuple[int, int]:
        """The model input's ``(height, width)`` an image of this size runs at: the imgsz square,
        or under a rect letterbox the smallest multiple of the stride holding it. Images of one
        input size may share a run (the batcher and the folder group them by it)."""
        if self.shape.letterbox == "square":
            return self.meta.imgsz, self.meta.imgsz
        return input_size(height, width, self.meta.imgsz, self.meta.stride)

    def info(self) -> dict[str, Any]:
        return {
            "model": self.meta.name,
            "backend": self.backend,
            "precision": self.precision,
            "imgsz": self.meta.imgsz,
            "letterbox": self.shape.letterbox,
            "max_batch": self.shape.max_batch,
            "class_names": self.names,
            "weights_sha256": self.meta.weights_sha256,
        }

    def params(self, **kwargs: Any) -> DetectParams:
        return make_params(**kwargs, num_classes=len(self.names))

    # --- one image ---------------------------------------------------------------------
    def encoded(self, data: bytes) -> EncodedImage:
        """``data`` with its header, read and checked (format, size, decode memory) before any
        pixel: the one read of it, by whoever first holds the bytes."""
        data = bytes(data)
        return EncodedImage(data, check_image(data, max_pixels=self.shape.max_pixels))

    @property
    def decodes_jpeg(self) -> bool:
        """Whether its pipeline decodes JPEGs itself: ``prepare`` then only reads and checks them."""
        return self.pipeline.decodes_jpeg

    def gpu_decodes(self, header: ImageHeader) -> bool:
        """Whether the pipeline decodes the image of this header itself: a JPEG the GPU decoders
        take (``ImageHeader.gpu_decodable``, the one test of it); CMYK, 12-bit, arithmetic and
        lossless ones decode on the CPU, like Ultralytics."""
        return self.pipeline.decodes_jpeg and header.gpu_decodable

    def prepare(self, item: Item) -> PipelineInput:
        """What the pipeline takes for ``item``: decoded on the CPU (OpenCV) unless the pipeline
        decodes it itself; bytes are read first (``encoded``). Raises the image's error. Front ends
        that decode in threads of their own (the folder's readers, the batcher's pool) call it
        there, then ``run_prepared``."""
        if isinstance(item, YolopipeError):
            raise item
        if isinstance(item, DeviceNv12):
            if not self.takes_nv12:
                raise InvalidParameter(f"the {self.backend} pipeline takes no device NV12 frames")
            return item
        if isinstance(item, np.ndarray):
            if item.ndim != 3 or item.shape[2] != 3 or item.dtype != np.uint8:
                raise InvalidParameter(f"arrays must be BGR uint8 [H, W, 3], got {item.dtype} {item.shape}")
            return item
        image = item if isinstance(item, EncodedImage) else self.encoded(item)
        if self.gpu_decodes(image.header):
            return image  # the GPU decodes it; a corrupt one comes back as an error in its place
        return decode_image(image.data, max_pixels=self.shape.max_pixels, header=image.header)

    # --- a batch -------------------------------------------------------------------------
    def run(self, items: Sequence[Item], params: DetectParams | None = None) -> DetectedBatch:
        """Every item's answer, in order: each image's error or its rows in source pixels. Items
        that fail to prepare fail alone; a run that fails as a whole raises (``DeviceError``)."""
        prepared: list[PipelineInput | YolopipeError] = []
        for item in items:
            try:
                prepared.append(self.prepare(item))
            except YolopipeError as exc:
                prepared.append(exc)
        return self.run_prepared(prepared, params)

    def run_prepared(self, items: Sequence[PipelineInput | YolopipeError], params: DetectParams | None = None
                     ) -> DetectedBatch:
        """``run`` on items ``prepare`` already gave (or the errors it raised, each that image's
        answer), as front ends that prepare in threads of their own have them: none is checked again."""
        params = params or DetectParams()
        errors: dict[int, YolopipeError] = {}
        ready: list[tuple[int, PipelineInput]] = []
        for i, item in enumerate(items):
            if isinstance(item, YolopipeError):
                errors[i] = item
            else:
                ready.append((i, item))
        runs = self._runs(ready)

        def run(part: list[tuple[int, PipelineInput]]) -> PipelineRun:
            return self.pipeline.run([x for _, x in part], params, decode=self.shape.decode)

        placed: list[tuple[int, Any]] = []  # (position, (rows, letterbox))
        timings, facts = StageTimes(), []
        for part, done in zip(runs, run_overlapped(run, runs, self.shape.in_flight if len(runs) > 1 else 1)):
            timings += done.timings  # stage times add up over the runs; facts (slot, bucket) never do
            if done.facts is not None:
                facts.append(done.facts)
            for (i, _), out in zip(part, done.images):
                if isinstance(out, YolopipeError):
                    errors[i] = out
                else:
                    placed.append((i, out))
        return _detected(len(items), sorted(placed, key=lambda p: p[0]), errors, timings, tuple(facts))

    def _runs(self, ready: list[tuple[int, PipelineInput]]) -> list[list[tuple[int, PipelineInput]]]:
        """Pipeline-sized runs: under a rect letterbox one input size per run (sizes in the order
        they first come), device frames apart from host images (a GPU run holds one kind)."""
        if self.shape.letterbox == "rect":
            sizes: dict[tuple[int, int], list[tuple[int, PipelineInput]]] = {}
            for x in ready:
                sizes.setdefault(self.input_size(*source_size(x[1])), []).append(x)
            return [run for same in sizes.values() for run in self._kind_runs(same)]
        return self._kind_runs(ready)

    def _kind_runs(self, ready: list[tuple[int, PipelineInput]]) -> list[list[tuple[int, PipelineInput]]]:
        on_device = [x for x in ready if isinstance(x[1], DeviceNv12)]
        on_host = [x for x in ready if not isinstance(x[1], DeviceNv12)] if on_device else ready
        step = self.shape.max_batch
        return [group[k : k + step] for group in (on_host, on_device) for k in range(0, len(group), step)]

    def detect(self, items: Sequence[Item], params: DetectParams | None = None) -> list[ImageResult]:
        """``run``'s answers as an ``ImageResult`` per item (for callers that want objects)."""
        return self.run(items, params).results()

    def run_batches(self, batches: Iterable[Sequence[Item]], params: DetectParams | None = None
                    ) -> Iterator[DetectedBatch]:
        """``run`` on each batch, up to ``shape.in_flight`` at once; answers in order."""
        return run_overlapped(lambda items: self.run(items, params), batches, self.shape.in_flight)

    # --- the pipeline's resources -------------------------------------------------------
    def warmup(self, batches: Sequence[int] | None = None, *, nv12: bool = False,
               frame_size: tuple[int, int] | None = None) -> None:
        """Do now the one-time work of these batch sizes (all buckets by default), not on first
        use: a GPU pipeline captures their CUDA graphs (``nv12``: those of device NV12 batches),
        and with ``frame_size`` (the height, width of NV12 frames to come) first makes room for
        a batch of them, so that no batch of such frames captures anything later."""
        self.pipeline.warmup(batches, nv12=nv12, frame_size=frame_size)

    def release_memory(self) -> None:
        """Give back what batches left cached (``Pipeline.release_memory``); safe at any time."""
        self.pipeline.release_memory()

    def close(self) -> None:
        self.pipeline.close()

    # --- what the benchmarks and checks look at ------------------------------------------
    def diagnose(self, *, profile: Sequence[Item] | None = None, params: DetectParams | None = None,
                 bare: np.ndarray | None = None, measure: Callable[[Callable[[], object]], list[float]] = measure_once,
                 timeline: bool = False) -> Diagnostics:
        """What the model is and how it runs (``app.contracts.Diagnostics``), under this shape's
        JPEG decoder; each keyword asks for more: ``profile``: one run of these items (at most
        ``max_batch``, under a rect letterbox of one input size, each one that prepares) with
        ``params`` on the profiling path (each stage's own time, device stages too); ``bare``: the
        engine alone on this letterboxed batch, its calls timed by ``measure``; ``timeline`` (GPU):
        record every batch's stages from now on, until the timeline it answers is closed."""
        run = ([self.prepare(x) for x in profile], params or DetectParams()) if profile is not None else None
        return self.pipeline.diagnose(decode=self.shape.decode, profile=run, bare=bare, measure=measure,
                                      timeline=timeline)

    def __enter__(self) -> Detector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def source_size(image: PipelineInput) -> tuple[int, int]:
    """An image's ``(height, width)`` as it will be decoded: its pixels', a device frame's, or
    for a JPEG its header's, turned by its EXIF orientation as every decoder turns it."""
    if isinstance(image, np.ndarray):
        return image.shape[0], image.shape[1]
    if isinstance(image, DeviceNv12):
        return image.height, image.width
    return image.header.upright_size


def _detected(n: int, placed: list[tuple[int, Any]], errors: dict[int, YolopipeError], timings: StageTimes,
              runs: tuple[RunFacts, ...]) -> DetectedBatch:
    """The answers as arrays: each placed image's NMS rows taken to source pixels, all at once."""
    sizes = np.zeros((3, n), np.int64)  # widths, heights, counts
    if not placed:
        return DetectedBatch(*sizes, np.zeros((0, 6), np.float32), errors, timings, runs)
    parts = [np.asarray(rows, np.float32).reshape(-1, 6) for _, (rows, _) in placed]
    boxes = [lb for _, (_, lb) in placed]
    sizes[:, [i for i, _ in placed]] = np.array([(lb.src_w, lb.src_h, len(p)) for lb, p in zip(boxes, parts)],
                                                np.int64).T
    rows = np.concatenate(parts)  # a copy: the pipeline's own rows are left as they were
    rows[:, :4] = scale_boxes_stacked(rows[:, :4], boxes, [len(p) for p in parts])
    return DetectedBatch(*sizes, rows, errors, timings, runs)
