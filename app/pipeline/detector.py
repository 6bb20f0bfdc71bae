"""The one detector API shared by every backend: images (bytes or arrays) in, detections out.

``yolopipe predict`` and the HTTP service both use it. It validates parameters, decodes what
the pipeline does not decode itself, splits work into batches the pipeline takes, and turns
NMS rows in input pixels into detections in original pixels.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.backends.base import Pipeline, PipelineInput
from app.errors import BackendUnavailable, EngineMismatch, InvalidParameter, YolopipeError
from app.boxes import rows_to_detections
from app.imaging.decode import DEFAULT_MAX_PIXELS, decode_image
from app.imaging.headers import image_size, sniff_format
from app.pipeline.overlap import run_overlapped
from app.types import Detections, DetectParams, ModelMeta

BACKENDS = ("auto", "onnxruntime", "torch-cuda", "tensorrt")
PRECISIONS = ("auto", "fp32", "fp16", "int8")


def make_params(
    conf: float = 0.25,
    iou: float = 0.7,
    max_det: int = 300,
    classes: Sequence[int] | None = None,
    agnostic: bool = False,
    *,
    num_classes: int | None = None,
    max_det_limit: int = 1000,
) -> DetectParams:
    """Validated ``DetectParams``; ``InvalidParameter`` names the offending value."""
    if not 0.0 <= conf <= 1.0:
        raise InvalidParameter(f"conf must be within [0, 1], got {conf}")
    if not 0.0 <= iou <= 1.0:
        raise InvalidParameter(f"iou must be within [0, 1], got {iou}")
    if not 1 <= max_det <= max_det_limit:
        raise InvalidParameter(f"max_det must be within [1, {max_det_limit}], got {max_det}")
    if classes is not None:
        classes = tuple(int(c) for c in classes)
        bad = [c for c in classes if c < 0 or (num_classes is not None and c >= num_classes)]
        if bad:
            raise InvalidParameter(f"unknown class ids {bad}; this model has classes 0..{(num_classes or 1) - 1}")
    return DetectParams(float(conf), float(iou), int(max_det), classes, bool(agnostic))


@dataclass
class ImageResult:
    """One image's outcome: detections with the source size, or the error that stopped it."""

    width: int = 0
    height: int = 0
    detections: Detections | None = None
    error: YolopipeError | None = None

    def to_json(self, image: str, names: list[str]) -> dict[str, Any]:
        if self.error is not None:
            return {"image": image, "error": str(self.error)}
        assert self.detections is not None
        return {
            "image": image,
            "width": self.width,
            "height": self.height,
            "detections": self.detections.to_json(names),
        }


class Detector:
    """Owns one pipeline (and through it the backend and every GPU resource).

    ``detect`` and ``detect_batches`` keep up to ``pipeline.max_in_flight`` batches in flight
    (``app.pipeline.overlap``): on the GPU, the decode and upload of one batch overlap with the
    graph of the one before.
    """

    def __init__(self, pipeline: Pipeline, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self.pipeline = pipeline
        self.max_pixels = max_pixels

    # --- facts -----------------------------------------------------------------------
    @property
    def meta(self) -> ModelMeta:
        return self.pipeline.meta

    @property
    def names(self) -> list[str]:
        return self.pipeline.meta.names

    def info(self) -> dict[str, Any]:
        return {
            "model": self.meta.name,
            "backend": self.pipeline.backend,
            "precision": self.pipeline.precision,
            "imgsz": self.meta.imgsz,
            "max_batch": self.pipeline.max_batch,
            "class_names": self.names,
            "weights_sha256": self.meta.weights_sha256,
        }

    def params(self, **kwargs: Any) -> DetectParams:
        # GPU pipelines size their output buffers for a max_det fixed at start-up
        return make_params(**kwargs, num_classes=len(self.names), max_det_limit=self.pipeline.max_det)

    # --- work ------------------------------------------------------------------------
    def prepare(self, item: bytes | np.ndarray) -> PipelineInput:
        """Decode on the CPU unless the pipeline decodes this item itself (JPEG on the GPU)."""
        if isinstance(item, np.ndarray):
            if item.ndim != 3 or item.shape[2] != 3 or item.dtype != np.uint8:
                raise InvalidParameter(f"arrays must be BGR uint8 [H, W, 3], got {item.dtype} {item.shape}")
            return item
        data = bytes(item)
        if self.pipeline.decodes_jpeg and sniff_format(data) == "jpeg":
            size = image_size(data)
            if size is not None and size[0] * size[1] <= self.max_pixels:
                return data  # the GPU decodes it; a corrupt one comes back as an error in its slot
        return decode_image(data, max_pixels=self.max_pixels)

    def detect(self, items: Sequence[bytes | np.ndarray], params: DetectParams | None = None) -> list[ImageResult]:
        """Detections for each item, in order; a bad item gets an error, the others go on."""
        params = params or DetectParams()
        results: list[ImageResult] = [ImageResult() for _ in items]
        ready: list[tuple[int, PipelineInput]] = []
        for i, item in enumerate(items):
            try:
                ready.append((i, self.prepare(item)))
            except YolopipeError as exc:
                results[i].error = exc
        step = self.pipeline.max_batch
        chunks = [ready[start : start + step] for start in range(0, len(ready), step)]

        def run(chunk: list[tuple[int, PipelineInput]]) -> list:
            return self.pipeline.run([x for _, x in chunk], params)

        depth = self.pipeline.max_in_flight if len(chunks) > 1 else 1
        for chunk, outs in zip(chunks, run_overlapped(run, chunks, depth)):
            for (i, _), out in zip(chunk, outs):
                if isinstance(out, YolopipeError):
                    results[i].error = out
                    continue
                rows, lb = out
                results[i] = ImageResult(lb.src_w, lb.src_h, rows_to_detections(rows, lb))
        return results

    def detect_batches(
        self, batches: Iterable[Sequence[bytes | np.ndarray]], params: DetectParams | None = None
    ) -> Iterator[list[ImageResult]]:
        """``detect`` on each batch, up to ``pipeline.max_in_flight`` at once; results in order."""
        return run_overlapped(lambda items: self.detect(items, params), batches, self.pipeline.max_in_flight)

    def close(self) -> None:
        self.pipeline.close()

    def __enter__(self) -> Detector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _choose_backend(backend: str, model_dir: Path, precision: str) -> str:
    if backend != "auto":
        return backend
    from app.gpu.probe import cuda_device_count

    if cuda_device_count() == 0:
        return "onnxruntime"
    from app.artifacts.engines import find_engine  # only imports tensorrt lazily, when it loads one

    if find_engine(model_dir, None if precision == "auto" else precision) is not None:
        return "tensorrt"
    return "torch-cuda"


def open_detector(
    weights: str = "sample",
    *,
    backend: str = "auto",
    precision: str = "auto",
    imgsz: int = 640,
    engines_dir: Path = Path("engines"),
    name: str | None = None,
    max_batch: int = 32,
    device: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    compile: bool = True,
) -> Detector:
    """Export if needed, pick the backend, build its pipeline. The one place that wires them."""
    from app.builder.export import export_onnx

    if backend not in BACKENDS:
        raise InvalidParameter(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if precision not in PRECISIONS:
        raise InvalidParameter(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    exported = export_onnx(weights, imgsz=imgsz, name=name, engines_dir=engines_dir)
    model_dir, meta = exported.onnx_path.parent, exported.meta
    chosen = _choose_backend(backend, model_dir, precision)

    if chosen == "onnxruntime":
        from app.backends.onnxruntime import OnnxRuntimeBackend
        from app.pipeline.cpu import CpuPipeline

        prec = "fp32" if precision == "auto" else precision
        if prec == "fp16":
            raise InvalidParameter("onnxruntime runs fp32 or int8 on the CPU; fp16 needs a GPU backend")
        onnx_path = exported.onnx_path
        if prec == "int8":
            from app.artifacts.int8 import int8_cpu_model_path

            onnx_path = int8_cpu_model_path(model_dir)
        threads = int(os.environ.get("YOLOPIPE_ORT_THREADS", "0")) or None
        host = OnnxRuntimeBackend(onnx_path, precision=prec, threads=threads)
        return Detector(CpuPipeline(host, meta, max_batch=min(max_batch, 16)), max_pixels=max_pixels)

    from app.gpu.probe import cuda_device_count

    if cuda_device_count() == 0:
        raise BackendUnavailable(f"backend {chosen} needs an NVIDIA GPU and none was found", hint="use --backend onnxruntime")
    from app.gpu.pipeline import GpuPipeline

    engine = None
    if chosen == "tensorrt":
        from app.artifacts.engines import find_engine
        from app.backends.tensorrt import TensorRTEngine

        engine_path = find_engine(model_dir, None if precision == "auto" else precision)
        if engine_path is None:
            raise BackendUnavailable(
                f"no TensorRT engine in {model_dir}", hint="run `yolopipe build-engine` first"
            )
        try:
            engine = TensorRTEngine(engine_path, meta, device=device)
        except (EngineMismatch, BackendUnavailable) as exc:
            if backend != "auto":
                raise
            # auto: an engine built for another GPU/TensorRT must not stop the service from starting
            warnings.warn(f"TensorRT engine unusable here ({exc}); falling back to torch-cuda", stacklevel=2)
            chosen, precision = "torch-cuda", "auto" if precision == "int8" else precision
    if chosen == "torch-cuda":
        from app.backends.torch_cuda import TorchCudaEngine

        prec = "fp16" if precision == "auto" else precision
        engine = TorchCudaEngine(model_dir, meta, precision=prec, max_batch=max_batch, device=device, compile=compile)
    if engine is None:
        raise InvalidParameter(f"unknown backend {chosen!r}")
    return Detector(GpuPipeline(engine, meta, max_batch=max_batch, device=device), max_pixels=max_pixels)
