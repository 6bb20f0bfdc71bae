"""ONNX Runtime on the CPU: the embedded default on a machine with no GPU (fp32 or Q/DQ int8)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from app.errors import ArtifactError, BackendUnavailable


class OnnxRuntimeBackend:
    """Owns one ``InferenceSession``; ``infer`` runs a whole batch in one call."""

    name = "onnxruntime"

    def __init__(self, onnx_path: Path, *, precision: str = "fp32", threads: int | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:  # a core dependency, but say so plainly if it is gone
            raise BackendUnavailable("onnxruntime is not installed", hint="pip install onnxruntime") from exc
        if not Path(onnx_path).is_file():
            raise ArtifactError(f"ONNX model not found: {onnx_path}")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads or os.cpu_count() or 1
        self.precision = precision
        self._session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
        self._input_name = self._session.get_inputs()[0].name
        self._output_name = self._session.get_outputs()[0].name

    def infer(self, batch: np.ndarray) -> np.ndarray:
        return self._session.run([self._output_name], {self._input_name: batch})[0]

    def close(self) -> None:
        self._session = None
