"""What a backend is: the thing that turns a preprocessed batch into the raw head output.

Two shapes, because where the data lives decides everything:

* ``HostBackend`` (ONNX Runtime): NumPy ``[B, 3, S, S]`` float32 in, NumPy ``[B, 4+nc, A]`` out.
  Preprocessing and NMS around it run on the CPU (``app.pipeline.cpu``).
* ``DeviceEngine`` (torch-cuda, TensorRT): a device tensor in, a device array out, enqueued on
  torch's current CUDA stream and capturable in a CUDA graph. Preprocessing and NMS around it
  run on the GPU (``app.gpu.pipeline``), and the output never leaves the device.

And one shape for the whole image→rows path, which the ``Detector`` drives: ``Pipeline``.
These are the whole contract: every attribute and method named here exists on every
implementation, so callers never probe for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from app.errors import YolopipeError
from app.types import DetectParams, Letterbox, ModelMeta


class HostBackend(Protocol):
    name: str  # "onnxruntime"
    precision: str  # "fp32" | "int8"

    def infer(self, batch: np.ndarray) -> np.ndarray:
        """``[B, 3, S, S]`` float32 RGB in [0, 1] → ``[B, 4 + nc, anchors]`` float32."""

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


# One image as a pipeline takes it: decoded BGR uint8 HWC pixels, or JPEG bytes for a pipeline
# that decodes JPEG itself (``Pipeline.decodes_jpeg``).
PipelineInput = np.ndarray | bytes


class Pipeline(Protocol):
    """Images → NMS rows ``[K, 6]`` (x1, y1, x2, y2, score, class) in input pixels, per image."""

    backend: str
    precision: str
    max_batch: int
    max_det: int  # the most rows per image ``run`` can return: the ceiling of a request's max_det
    max_in_flight: int  # ``run`` calls (each from its own thread) that overlap usefully; 1: serial
    meta: ModelMeta
    decodes_jpeg: bool  # True: JPEG bytes may be passed and are decoded by the pipeline
    last_timings: dict[str, float]  # stage times of the last ``run`` (``*_ms``, ``*_us``), for metrics

    def run(
        self, images: Sequence[PipelineInput], params: DetectParams
    ) -> list[tuple[np.ndarray, Letterbox] | YolopipeError]:
        """At most ``max_batch`` images; a per-image error (e.g. a corrupt JPEG) stands in its slot."""

    def warmup(self, batches: Sequence[int] | None = None) -> None:
        """Do now the one-time work of these batch sizes (all by default), not on first use:
        the GPU pipeline captures their CUDA graphs; a CPU pipeline has nothing to do."""

    def close(self) -> None: ...
