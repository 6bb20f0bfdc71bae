"""What a backend implements: it turns a preprocessed batch into the raw head output, in one of
two shapes, because where the data lives decides everything:

* ``HostBackend`` (ONNX Runtime): NumPy ``[B, 3, S, S]`` float32 in, NumPy ``[B, 4+nc, A]`` out.
  Preprocessing and NMS around it run on the CPU (``app.pipeline.cpu``).
* ``DeviceEngine`` (torch-cuda, TensorRT): a device tensor in, a device array out, enqueued on
  torch's current CUDA stream and capturable in a CUDA graph. Preprocessing and NMS around it
  run on the GPU (``app.pipeline.gpu``), and the output never leaves the device.

The pipelines around them implement ``app.contracts.Pipeline``.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class HostBackend(Protocol):
    name: str  # "onnxruntime"
    precision: str  # "fp32" | "int8"
    takes_rect: bool  # its model takes any input height and width (rect inputs), not only the imgsz square

    def infer(self, batch: np.ndarray) -> np.ndarray:
        """``[B, 3, H, W]`` float32 RGB in [0, 1] (``H × W``: the square, or a rect input where
        ``takes_rect``) → ``[B, 4 + nc, anchors]`` float32."""

    def release_memory(self) -> None:
        """Free what the backend keeps between batches; the next ``infer`` allocates again."""

    def close(self) -> None: ...


class DeviceEngine(Protocol):
    name: str  # "torch-cuda" | "tensorrt"
    precision: str  # "fp32" | "fp16" | "int8"
    input_dtype: str  # "float32" | "float16": what ``forward`` expects
    max_batch: int
    compiled: bool  # torch-cuda: running a torch.compile'd model or a package; TensorRT: False (built ahead)
    compiler: str  # what made its kernels: aoti | inductor | eager (torch-cuda), tensorrt
    batch_invariant: bool  # an image gets the same answer in any batch (a torch-cuda package built so)

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
