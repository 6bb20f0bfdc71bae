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


def test_the_run_shape_is_clamped_once_where_the_detector_is_opened(sample_model_dir):
    """ONNX Runtime runs one batch at a time, of at most ``CPU_MAX_BATCH``: the detector carries
    that shape, and its pipeline was built for it (nothing downstream clamps again)."""
    from app.config import CPU_MAX_BATCH, Settings
    from app.contracts import RunShape
    from app.runtime import open_model_dir, shape_from

    settings = Settings(backend="onnxruntime", max_batch=64, max_pixels=1_000_000, max_wait_ms=7.5, decode="cpu")
    asked = shape_from(settings)
    assert asked == RunShape(max_batch=64, decode="opencv", max_pixels=1_000_000, max_wait_ms=7.5)
    with open_model_dir(sample_model_dir, asked, backend="onnxruntime") as det:
        assert det.shape == RunShape(max_batch=CPU_MAX_BATCH, in_flight=1, decode="opencv", max_pixels=1_000_000,
                                     max_wait_ms=7.5)
        assert det.pipeline.max_batch == det.info()["max_batch"] == CPU_MAX_BATCH
    with open_model_dir(sample_model_dir, RunShape(max_batch=4), backend="onnxruntime") as det:
        assert (det.shape.max_batch, det.pipeline.max_batch) == (4, 4)


def test_a_failed_open_closes_what_it_had_opened(sample_model_dir, monkeypatch):
    """A step that fails after the backend was opened releases it: nothing is left for the caller."""
    import app.runtime
    from app.contracts import RunShape
    from app.pipeline.cpu import CpuPipeline

    closed = []

    def refused(pipeline, shape):  # the last step, failing
        raise InvalidParameter("refused")

    monkeypatch.setattr(CpuPipeline, "close", lambda self: closed.append(self.backend))
    monkeypatch.setattr(app.runtime, "Detector", refused)
    with pytest.raises(InvalidParameter, match="refused"):
        app.runtime.open_model_dir(sample_model_dir, RunShape(max_batch=2), backend="onnxruntime")
    assert closed == ["onnxruntime"]


def test_a_gpu_pipeline_that_fails_to_set_up_leaves_no_engine_open(sample_model_dir, monkeypatch):
    import app.gpu.probe
    import app.pipeline.gpu
    import app.runtime
    from app.errors import DeviceError

    closed = []

    class Engine:
        max_batch = 8

        def close(self) -> None:
            closed.append("engine")

    def out_of_memory(*args, **kwargs):
        raise DeviceError("out of memory")

    monkeypatch.setattr(app.gpu.probe, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(app.runtime, "_device_engine", lambda *args: Engine())
    monkeypatch.setattr(app.pipeline.gpu, "GpuPipeline", out_of_memory)
    with pytest.raises(DeviceError, match="out of memory"):
        app.runtime.open_model_dir(sample_model_dir, backend="torch-cuda")
    assert closed == ["engine"]


def test_a_decoder_name_is_checked_before_the_model_is_exported(tmp_path):
    from app.runtime import open_detector

    with pytest.raises(InvalidParameter, match="unknown decoder 'libjpeg'; choose one of gpu, nvimgcodec, nvjpeg, opencv"):
        open_detector("no-such-weights.pt", decode="libjpeg", artifacts_dir=tmp_path)
    with pytest.raises(InvalidParameter, match="unknown video decoder"):
        open_detector("no-such-weights.pt", video_decode="gpu", artifacts_dir=tmp_path)
