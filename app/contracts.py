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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from app.config import CONF, IOU, MAX_DET
from app.errors import InvalidParameter, YolopipeError
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
    """

    planes: Any
    height: int
    width: int


# One image as a pipeline takes it: decoded BGR uint8 HWC pixels, JPEG bytes for a pipeline
# that decodes JPEG itself (``Pipeline.decodes_jpeg``), or a device NV12 frame for one that
# takes them (``Pipeline.takes_nv12``; a batch holds only those, or none).
PipelineInput = np.ndarray | bytes | DeviceNv12


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
    max_in_flight: int  # ``run`` calls (each from its own thread) that overlap usefully; 1: serial
    meta: ModelMeta
    decodes_jpeg: bool  # True: JPEG bytes may be passed and are decoded by the pipeline
    takes_nv12: bool  # True: ``DeviceNv12`` frames may be passed (a batch of them only)
    device: int | None  # the CUDA device a GPU pipeline runs on (its NV12 frames' too); None on the CPU

    def run(self, images: Sequence[PipelineInput], params: DetectParams) -> PipelineRun:
        """At most ``max_batch`` images; a per-image error (e.g. a corrupt JPEG) stands in its slot.
        Safe to call from ``max_in_flight`` threads at once."""

    def warmup(self, batches: Sequence[int] | None = None, *, nv12: bool = False) -> None:
        """Do now the one-time work of these batch sizes (all by default), not on first use:
        the GPU pipeline captures their CUDA graphs (``nv12``: those of device NV12 batches);
        a CPU pipeline has nothing to do."""

    def release_memory(self) -> None:
        """Give back what batches left cached (an idle server calls it after a burst): ONNX
        Runtime's arena, torch's cached GPU blocks, staging grown for large images. Safe to
        call at any time; the next ``run`` allocates (and on a GPU captures) again."""

    def close(self) -> None: ...
