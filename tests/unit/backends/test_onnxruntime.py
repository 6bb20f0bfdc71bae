"""ONNX Runtime's memory options (the arena, the memory pattern) change what a run holds, never
what it answers: every combination gives the same outputs, bit for bit, on real photos, and a
session keeps answering the same after its arena was given back."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from app.backends.onnxruntime import OnnxRuntimeBackend
from app.imaging.letterbox import letterbox, to_input


@pytest.fixture(scope="module")
def batch(bus, zidane) -> np.ndarray:
    photos = [cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR) for data in (bus, zidane)]
    return to_input([letterbox(p, 640)[0] for p in photos])


@pytest.fixture(scope="module")
def reference(sample_model_dir, batch) -> np.ndarray:
    """The outputs with both of ONNX Runtime's own defaults on (arena and pattern)."""
    backend = OnnxRuntimeBackend(sample_model_dir / "model.onnx", threads=1, memory_arena=True, memory_pattern=True)
    out = backend.infer(batch)
    assert out.shape == (2, 6, 8400) and out[:, 4:].max() > 0.5  # confident detections: the comparison bites
    return out


@pytest.mark.parametrize("arena, pattern", [(True, False), (False, True), (False, False)])
def test_memory_options_answer_the_same(sample_model_dir, batch, reference, arena, pattern):
    backend = OnnxRuntimeBackend(sample_model_dir / "model.onnx", threads=1, memory_arena=arena, memory_pattern=pattern)
    np.testing.assert_array_equal(backend.infer(batch), reference)
    np.testing.assert_array_equal(backend.infer(batch[1:]), reference[1:])  # another batch size, same rows


def test_the_defaults_answer_the_same_after_a_release(sample_model_dir, batch, reference):
    backend = OnnxRuntimeBackend(sample_model_dir / "model.onnx", threads=1)
    np.testing.assert_array_equal(backend.infer(batch), reference)
    backend.release_memory()
    np.testing.assert_array_equal(backend.infer(batch), reference)
