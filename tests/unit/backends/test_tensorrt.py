"""The TensorRT runtime's refusals that come before TensorRT is touched (any machine)."""

from __future__ import annotations

import pytest

from app.errors import ArtifactError, BackendUnavailable
from tests.engine_files import HAS_TENSORRT, make_engine_dir, model_meta


def test_engine_without_metadata_is_refused(tmp_path):
    from app.backends.tensorrt import TensorRTEngine

    d = make_engine_dir(tmp_path / "m", ["fp16"], described=[])
    with pytest.raises(ArtifactError, match="no entry for model.fp16.engine"):
        TensorRTEngine(d / "model.fp16.engine", model_meta())


def test_engine_from_another_export_is_refused(tmp_path):
    from app.backends.tensorrt import TensorRTEngine

    d = make_engine_dir(tmp_path / "m", ["fp16"])
    with pytest.raises(ArtifactError, match="another export") as info:
        TensorRTEngine(d / "model.fp16.engine", model_meta(onnx_sha256="d" * 64))
    assert "--precision fp16" in info.value.hint
    with pytest.raises(ArtifactError, match="imgsz 640 and 2 classes"):
        TensorRTEngine(d / "model.fp16.engine", model_meta(names=["a", "b", "c"]))


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
def test_engine_without_tensorrt_is_backend_unavailable(tmp_path):
    from app.backends.tensorrt import TensorRTEngine

    d = make_engine_dir(tmp_path / "m", ["fp16"])
    with pytest.raises(BackendUnavailable, match="TensorRT is not installed"):
        TensorRTEngine(d / "model.fp16.engine", model_meta())
