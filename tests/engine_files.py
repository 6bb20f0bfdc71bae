"""Engine folders as ``yolopipe build-engine`` leaves them, for tests that need no TensorRT: the
plan files hold placeholder bytes (nothing here deserializes them), engine.json is real."""

from __future__ import annotations

import importlib.util

from app.artifacts.engines import EngineMeta, engine_file_name, save_engine_meta
from app.types import ModelMeta


def real_tensorrt_installed() -> bool:
    # a folder named tensorrt on sys.path is importable as a namespace package: a real one has a file
    spec = importlib.util.find_spec("tensorrt")
    return spec is not None and spec.origin is not None


HAS_TENSORRT = real_tensorrt_installed()


def make_meta(precision: str = "fp16", **overrides) -> EngineMeta:
    values = dict(
        precision=precision,
        engine_file=engine_file_name(precision),
        trt_version="10.13.3.9",
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        min_batch=1,
        opt_batch=8,
        max_batch=64,
        imgsz=640,
        source_onnx="model.onnx",
        onnx_sha256="a" * 64,
        export_onnx_sha256="b" * 64,
        class_names=["Normal", "Fall"],
        weights="sample",
        created_at="2025-01-01T00:00:00+00:00",
        builder_options={"strongly_typed": False, "fp16_flag": True},
    )
    values.update(overrides)
    return EngineMeta(**values)



def make_engine_dir(path, precisions, described=None):
    path.mkdir(parents=True, exist_ok=True)
    for p in precisions:
        (path / engine_file_name(p)).write_bytes(b"plan")
    for p in precisions if described is None else described:
        save_engine_meta(path, make_meta(p))
    return path


def model_meta(**overrides) -> ModelMeta:
    values = dict(
        name="sample", names=["Normal", "Fall"], imgsz=640, stride=32, input_name="images", output_name="output0",
        input_shape=["batch", 3, 640, 640], output_shape=["batch", 6, 8400], opset=17,
        weights_sha256="c" * 64, onnx_sha256="b" * 64,
    )
    values.update(overrides)
    return ModelMeta(**values)
