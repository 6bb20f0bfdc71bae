"""The one resolver of ``auto``: which backend and precision a machine runs, from files and a GPU count."""

from __future__ import annotations

import pytest

from app.errors import BackendUnavailable, InvalidParameter
from app.runtime import choose_backend
from tests.engine_files import make_engine_dir


@pytest.mark.parametrize("backend, precision, gpus, engines, expected", [
    ("auto", "auto", 0, ["int8"], ("onnxruntime", "fp32")),  # an engine does not matter without a GPU
    ("auto", "int8", 0, [], ("onnxruntime", "int8")),
    ("auto", "auto", 1, [], ("torch-cuda", "fp16")),
    ("auto", "fp32", 1, [], ("torch-cuda", "fp32")),
    ("auto", "auto", 1, ["fp32", "int8"], ("tensorrt", "int8")),  # the fastest engine built
    ("auto", "fp16", 1, ["fp32", "int8"], ("torch-cuda", "fp16")),  # no fp16 engine: torch-cuda runs fp16
    ("tensorrt", "auto", 2, ["fp16"], ("tensorrt", "fp16")),
    ("onnxruntime", "auto", 1, ["int8"], ("onnxruntime", "fp32")),  # explicit choices are never changed
])
def test_auto_resolves_once_and_explicit_choices_stay(tmp_path, backend, precision, gpus, engines, expected):
    model_dir = make_engine_dir(tmp_path / "m", engines)
    choice = choose_backend(backend, precision, model_dir, gpus=gpus)
    assert (choice.backend, choice.precision) == expected
    assert (choice.engine_path is not None) == (expected[0] == "tensorrt")


@pytest.mark.parametrize("backend, precision, gpus, error, words", [
    ("onnxruntime", "fp16", 0, InvalidParameter, "fp16 needs a GPU backend"),
    ("torch-cuda", "auto", 0, BackendUnavailable, "needs an NVIDIA GPU"),
    ("torch-cuda", "int8", 1, InvalidParameter, "int8 needs a TensorRT engine"),
    ("tensorrt", "fp32", 1, BackendUnavailable, "no TensorRT engine for fp32"),
    ("cuda", "auto", 1, InvalidParameter, "unknown backend 'cuda'"),
    ("auto", "bf16", 1, InvalidParameter, "unknown precision 'bf16'"),
])
def test_impossible_choices_are_one_clear_error(tmp_path, backend, precision, gpus, error, words):
    model_dir = make_engine_dir(tmp_path / "m", ["int8"])
    with pytest.raises(error, match=words):
        choose_backend(backend, precision, model_dir, gpus=gpus)
