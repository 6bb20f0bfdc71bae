"""ONNX Runtime on the CPU: the embedded default on a machine with no GPU (fp32 or Q/DQ int8)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from app.errors import ArtifactError, BackendUnavailable


class OnnxRuntimeBackend:
    """Owns one ``InferenceSession``; ``infer`` runs a whole batch in one call.

    ``memory_pattern`` is off by default: the pattern (one block planned for a whole run's
    activations) holds about twice what the arena alone does at its peak, 92 against 47 MB an
    image for the sample model at 640, and saves no measurable time on a run that takes
    hundreds of milliseconds (``python bench/memory_probe.py --engine-sweep``). ``memory_arena``
    off gives each run's memory back at its end, but pays page faults for it on every run."""

    name = "onnxruntime"

    def __init__(self, onnx_path: Path, *, precision: str = "fp32", threads: int | None = None,
                 memory_arena: bool = True, memory_pattern: bool = False) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:  # a core dependency, but say so plainly if it is gone
            raise BackendUnavailable("onnxruntime is not installed", hint="pip install onnxruntime") from exc
        if not Path(onnx_path).is_file():
            raise ArtifactError(f"ONNX model not found: {onnx_path}")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads or os.cpu_count() or 1
        opts.enable_cpu_mem_arena = memory_arena
        opts.enable_mem_pattern = memory_pattern
        self.precision = precision
        self._session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
        self._input_name = self._session.get_inputs()[0].name
        self._output_name = self._session.get_outputs()[0].name
        # A run with this option frees, when it ends, every region of the arena it left unused.
        self._shrink = ort.RunOptions()
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        _, *rest = self._session.get_inputs()[0].shape
        # the export's height and width are named, free dims; a model pinned to the square (the
        # INT8 one, an export from before rect inputs) has numbers there
        self.takes_rect = not any(isinstance(d, int) for d in rest[1:])
        # What release_memory runs: an empty batch (no compute) where the shapes are fixed; a
        # dynamic model's head reshapes to "-1 anchors", which no empty batch can take, so one image
        # at the smallest input (32 × 32, 1/400 of the square's work)
        self._idle_batch = np.zeros((1, 3, 32, 32) if self.takes_rect else (0, *rest), np.float32)

    def infer(self, batch: np.ndarray) -> np.ndarray:
        return self._session.run([self._output_name], {self._input_name: batch})[0]

    def release_memory(self) -> None:
        """Give the arena back: ONNX Runtime keeps it at the largest batch it ran (it grows by
        doubling regions and never shrinks by itself), so one burst of large batches would hold
        it there for good. A batch of (almost) no compute run with the shrink option frees every
        region it does not use. Safe beside a running batch: only free regions are freed."""
        if self._session is not None:
            self._session.run([self._output_name], {self._input_name: self._idle_batch}, self._shrink)

    def close(self) -> None:
        self._session = None
