"""TensorRT runtime: a built engine as a ``DeviceEngine`` (see ``app.engine_contracts``).

Shaped after NVIDIA's ``samples/python/common_runtime.py`` and Polygraphy's ``TrtRunner``: every
TensorRT call that reports failure (None / False) is checked and turned into a clear error, one
object owns each resource, and ``close()`` frees them in reverse order of creation, once.

The runtime API used here is the name-based tensor API of TensorRT 10, unchanged in 11.x:
``Runtime.deserialize_cuda_engine``, ``ICudaEngine.create_execution_context``,
``num_io_tensors`` / ``get_tensor_name`` / ``get_tensor_mode`` / ``get_tensor_dtype`` /
``get_tensor_shape`` / ``get_tensor_profile_shape``, and on the context ``set_input_shape``,
``set_tensor_address`` and ``execute_async_v3``. None of the APIs removed in 11.0 (weak-typing
builder flags, calibrators, ``device_memory_size*``) is used, so this file has no version branch.

tensorrt and torch are imported inside functions. Which engine file to load is decided from
files alone, in ``app.artifacts.engines.find_engine``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.artifacts.engines import (
    EngineMeta,
    check_engine_meta,
    engine_meta_for,
)
from app.errors import ArtifactError, DeviceError, InvalidParameter
from app.gpu.probe import gpu_identity
from app.gpu.tensorrt_lib import import_tensorrt, trt_logger
from app.types import ModelMeta


def _numpy_dtype_name(trt: Any, trt_dtype: Any) -> str:
    import numpy as np

    try:
        return np.dtype(trt.nptype(trt_dtype)).name
    except TypeError as exc:  # bf16, fp8, int4 have no NumPy type
        raise ArtifactError(f"unsupported engine I/O type {trt_dtype}; yolopipe engines use float32 or float16 I/O") from exc


# --- the engine --------------------------------------------------------------------------------
class TensorRTEngine:
    """One deserialized engine, its execution context and its output buffer (sized for max batch).

    ``forward`` enqueues on torch's current stream and returns a view of the preallocated output.
    The output address never changes (views start at offset 0), and the input address is the
    caller's tensor, so after one eager call per batch size the call can be captured in a CUDA
    graph. NVIDIA's CUDA-graph guidance for ``enqueueV3``: call it once after any input-shape
    change before capturing, and never change shapes inside a capture; ``forward`` refuses a
    shape change while the stream is capturing.
    """

    name = "tensorrt"
    compiled = False  # built ahead of time by `yolopipe build-engine`
    compiler = "tensorrt"
    batch_invariant = False  # not promised: its kernels may differ with the batch size

    def __init__(self, engine_path: Path, meta: ModelMeta, *, device: int = 0) -> None:
        self._runtime = self._engine = self._context = self._output = None
        self._closed = False
        engine_path = Path(engine_path)
        if not engine_path.is_file():
            raise ArtifactError(f"TensorRT engine not found: {engine_path}", hint="run `yolopipe build-engine` first")

        # 1. metadata checks first: a mismatched plan must never reach the deserializer
        self.engine_meta: EngineMeta = engine_meta_for(engine_path)
        em = self.engine_meta
        if meta.onnx_sha256 and em.export_onnx_sha256 and em.export_onnx_sha256 != meta.onnx_sha256:
            raise ArtifactError(
                f"TensorRT engine {engine_path.name} was built from another export of {meta.name} (the weights changed)",
                hint=f"yolopipe build-engine --weights {em.weights or 'WEIGHTS'} --precision {em.precision}",
            )
        if em.imgsz != meta.imgsz or list(em.class_names) != list(meta.names):
            raise ArtifactError(
                f"TensorRT engine {engine_path.name} is for imgsz {em.imgsz} and {len(em.class_names)} classes, "
                f"the model is imgsz {meta.imgsz} with {len(meta.names)} classes",
                hint=f"yolopipe build-engine --weights {em.weights or 'WEIGHTS'} --precision {em.precision}",
            )
        trt = import_tensorrt()
        import torch

        gpu_name, capability = gpu_identity(device)
        check_engine_meta(em, trt_version=trt.__version__, gpu_name=gpu_name, compute_capability=capability)

        self.device = device
        self.precision = em.precision
        self.meta = meta
        try:
            with torch.cuda.device(device):  # TensorRT allocates on the current CUDA device
                self._load(trt, torch, engine_path)
        except BaseException:
            self.close()
            raise

    def _load(self, trt: Any, torch: Any, engine_path: Path) -> None:
        self._runtime = trt.Runtime(trt_logger())
        if self._runtime is None:
            raise DeviceError("TensorRT could not create a runtime")
        self._engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self._engine is None:
            raise ArtifactError(
                f"TensorRT could not deserialize {engine_path} (see the TensorRT log above)",
                hint=f"yolopipe build-engine --weights {self.engine_meta.weights or 'WEIGHTS'} --precision {self.precision}",
            )

        engine = self._engine
        inputs, outputs = [], []
        for i in range(engine.num_io_tensors):
            tensor = engine.get_tensor_name(i)
            (inputs if engine.get_tensor_mode(tensor) == trt.TensorIOMode.INPUT else outputs).append(tensor)
        if len(inputs) != 1 or len(outputs) != 1:
            raise ArtifactError(f"expected one input and one output, the engine has inputs {inputs} and outputs {outputs}")
        self.input_name, self.output_name = inputs[0], outputs[0]
        self.input_dtype = _numpy_dtype_name(trt, engine.get_tensor_dtype(self.input_name))
        output_dtype = _numpy_dtype_name(trt, engine.get_tensor_dtype(self.output_name))
        if self.input_dtype not in ("float32", "float16") or output_dtype not in ("float32", "float16"):
            raise ArtifactError(f"engine I/O is {self.input_dtype} → {output_dtype}; yolopipe needs float32 or float16")

        # profile 0 is the only profile build_engine creates: (min, opt, max) shapes of the input
        min_shape, _, max_shape = (tuple(d) for d in engine.get_tensor_profile_shape(self.input_name, 0))
        self.min_batch, self.max_batch = int(min_shape[0]), int(max_shape[0])
        size = self.meta.imgsz
        if tuple(max_shape[1:]) != (3, size, size):
            raise ArtifactError(f"engine input is {tuple(max_shape)}, expected [batch, 3, {size}, {size}]")
        # (-1, 4 + nc, anchors); anchors -1 in an engine whose height and width are dynamic
        out_shape = tuple(engine.get_tensor_shape(self.output_name))
        expected = (4 + self.meta.num_classes, self.meta.num_anchors)
        if out_shape[1] != expected[0] or out_shape[2] not in (expected[1], -1):
            raise ArtifactError(f"engine output is {out_shape}, expected [batch, {expected[0]}, {expected[1]}]")

        self._context = engine.create_execution_context()
        if self._context is None:
            raise DeviceError("TensorRT could not create an execution context (out of GPU memory?)")

        # allocated once, for the largest batch; forward hands out views starting at offset 0
        torch_dtype = {"float32": torch.float32, "float16": torch.float16}[output_dtype]
        self._output = torch.empty((self.max_batch, *expected), dtype=torch_dtype, device=f"cuda:{self.device}")
        self._output_ptr = self._output.data_ptr()
        self._bound_shape: tuple[int, ...] | None = None
        self._torch = torch

    # --- DeviceEngine -------------------------------------------------------------------------
    def forward(self, images: Any) -> Any:
        """Enqueue on torch's current stream; returns the output view ``[B, 4 + nc, anchors]``."""
        if self._context is None:
            raise DeviceError("the TensorRT engine is closed")
        torch = self._torch
        shape = tuple(images.shape)
        if len(shape) != 4 or not self.min_batch <= shape[0] <= self.max_batch:
            raise InvalidParameter(
                f"TensorRT engine takes [B, 3, {self.meta.imgsz}, {self.meta.imgsz}] with "
                f"{self.min_batch} <= B <= {self.max_batch}, got {list(shape)}"
            )
        if str(images.dtype).removeprefix("torch.") != self.input_dtype or not images.is_cuda or not images.is_contiguous():
            raise InvalidParameter(f"TensorRT engine takes a contiguous CUDA {self.input_dtype} tensor, got {images.dtype} on {images.device}")

        stream = torch.cuda.current_stream(images.device)
        if shape != self._bound_shape:
            if torch.cuda.is_current_stream_capturing():
                raise DeviceError(
                    f"batch shape changed to {list(shape)} during CUDA graph capture; "
                    "run forward once eagerly with this shape before capturing"
                )
            if not self._context.set_input_shape(self.input_name, shape):
                raise DeviceError(f"TensorRT rejected input shape {list(shape)}")
            self._bound_shape = shape
        if not self._context.set_tensor_address(self.input_name, images.data_ptr()):
            raise DeviceError("TensorRT rejected the input address")
        if not self._context.set_tensor_address(self.output_name, self._output_ptr):
            raise DeviceError("TensorRT rejected the output address")
        if not self._context.execute_async_v3(stream.cuda_stream):
            raise DeviceError("TensorRT failed to enqueue the engine (see the TensorRT log above)")
        return self._output[: shape[0]]

    def close(self) -> None:
        """Free in reverse order of creation: context, engine, runtime, then the output buffer."""
        if self._closed:
            return
        self._closed = True
        self._context = None
        self._engine = None
        self._runtime = None
        self._output = None

    def __enter__(self) -> TensorRTEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
