"""The one resolver of ``auto``: which backend and precision a machine runs, from files and a GPU count."""

from __future__ import annotations

import os

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


def test_the_service_settings_become_one_options_value():
    """``options_from``: every setting that says which detector the service opens, in one place."""
    from pathlib import Path

    from app.contracts import RunShape
    from app.runtime import OpenOptions, options_from
    from app.settings import Settings

    settings = Settings(weights="w.pt", imgsz=320, artifacts_dir=Path("/a"), backend="torch-cuda", precision="fp32",
                        decode="cpu", device=1, compile=False, batch_invariant=False, ort_threads=3, max_batch=16,
                        max_pixels=1_000_000, max_wait_ms=7.5)
    assert options_from(settings) == OpenOptions(
        weights="w.pt", imgsz=320, artifacts_dir=Path("/a"), backend="torch-cuda", precision="fp32", device=1,
        compile=False, batch_invariant=False, ort_threads=3, pad_to_captured=True,
        shape=RunShape(max_batch=16, decode="opencv", max_pixels=1_000_000, max_wait_ms=7.5))


def test_the_run_shape_is_clamped_once_where_the_detector_is_opened(sample_model_dir):
    """ONNX Runtime runs one batch at a time, of at most ``CPU_MAX_BATCH``: the detector carries
    that shape, and its pipeline was built for it (nothing downstream clamps again)."""
    from dataclasses import replace

    from app.config import CPU_MAX_BATCH
    from app.contracts import RunShape
    from app.runtime import OpenOptions, cpu_shape, open_model_dir, options_from
    from app.settings import Settings

    settings = Settings(backend="onnxruntime", max_batch=64, max_pixels=1_000_000, max_wait_ms=7.5, decode="cpu")
    asked = options_from(settings)
    assert asked.shape == RunShape(max_batch=64, decode="opencv", max_pixels=1_000_000, max_wait_ms=7.5)
    with open_model_dir(sample_model_dir, asked) as det:
        assert det.shape == cpu_shape(asked.shape) == RunShape(max_batch=CPU_MAX_BATCH, in_flight=1, decode="opencv",
                                                               max_pixels=1_000_000, max_wait_ms=7.5)
        assert det.pipeline.max_batch == det.info()["max_batch"] == CPU_MAX_BATCH
    with open_model_dir(sample_model_dir, replace(asked, shape=RunShape(max_batch=4))) as det:
        assert (det.shape.max_batch, det.pipeline.max_batch) == (4, 4)
    with open_model_dir(sample_model_dir, OpenOptions(backend="onnxruntime", ort_threads=1)) as det:
        assert det.info()["backend"] == "onnxruntime"


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
        app.runtime.open_model_dir(sample_model_dir, app.runtime.OpenOptions(backend="onnxruntime",
                                                                             shape=RunShape(max_batch=2)))
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
        app.runtime.open_model_dir(sample_model_dir, app.runtime.OpenOptions(backend="torch-cuda"))
    assert closed == ["engine"]


def test_a_gpu_pipeline_gets_its_devices_one_context_made_after_the_cuda_setting(sample_model_dir, monkeypatch):
    """The runtime sets CUDA's work-queue count before anything makes a CUDA context (the engine
    comes first), and hands the GPU pipeline the process's one ``CudaDevice`` of its device:
    every pipeline and NVDEC reader on a device shares its gate."""
    import app.gpu.probe
    import app.pipeline.gpu
    import app.runtime
    from app.errors import DeviceError
    from app.gpu.device import CudaDevice
    from app.runtime import OpenOptions

    seen: list = []

    class Engine:
        max_batch = 8

        def close(self) -> None:
            pass

    def engine(*args):
        seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        return Engine()

    def pipeline(engine, meta, shape, cuda, **kwargs):
        seen.append(cuda)
        raise DeviceError("stop here")

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(app.gpu.probe, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(app.runtime, "_device_engine", engine)
    monkeypatch.setattr(app.pipeline.gpu, "GpuPipeline", pipeline)
    for device in (1, 1, 0):
        with pytest.raises(DeviceError, match="stop here"):
            app.runtime.open_model_dir(sample_model_dir, OpenOptions(backend="torch-cuda", device=device))
    assert seen[0::2] == ["32"] * 3
    first, again, other = seen[1::2]
    assert isinstance(first, CudaDevice) and (first.index, other.index) == (1, 0)
    assert again is first is app.runtime.cuda_device(1) and other is not first
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")  # a user's own setting wins
    with pytest.raises(DeviceError, match="stop here"):
        app.runtime.open_model_dir(sample_model_dir, OpenOptions(backend="torch-cuda"))
    assert seen[-2] == "4"


@pytest.mark.parametrize("fields, words", [
    ({"shape": {"decode": "libjpeg"}}, "unknown decoder 'libjpeg'; choose one of gpu, nvimgcodec, nvjpeg, opencv"),
    ({"shape": {"video_decode": "gpu"}}, "unknown video decoder"),
    ({"backend": "cuda"}, "unknown backend 'cuda'"),
    ({"precision": "int4"}, "unknown precision 'int4'"),
    ({"imgsz": 100}, "imgsz must be a multiple of 32"),
    ({"ort_threads": -1}, "ort_threads and device must be >= 0"),
])
def test_options_are_checked_when_made_before_any_slow_step(tmp_path, fields, words):
    from app.contracts import RunShape
    from app.runtime import OpenOptions

    with pytest.raises(InvalidParameter, match=words):
        shape = RunShape(**fields.pop("shape", {}))
        OpenOptions("no-such-weights.pt", artifacts_dir=tmp_path, shape=shape, **fields)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def linked_root(tmp_path, sample_model_dir):
    """An artifacts root holding the sample export (hard links: no copy of the weights)."""
    import os
    import shutil

    root = tmp_path / "artifacts"
    shutil.copytree(sample_model_dir, root / sample_model_dir.relative_to(sample_model_dir.parents[1]),
                    copy_function=os.link, ignore=shutil.ignore_patterns("torch-cache", "torch-cuda"))
    return root


def test_opening_never_exports_and_names_the_command_that_does(tmp_path, linked_root, sample_model_dir, bus,
                                                                monkeypatch):
    """``open_detector`` finds the export or says how to make it; ``ensure_artifacts`` makes it (here:
    finds it current, and exports nothing)."""
    import app.builder.export
    from app.errors import ArtifactError
    from app.runtime import OpenOptions, ensure_artifacts, open_detector

    empty = tmp_path / "empty root"
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=empty)
    with pytest.raises(ArtifactError, match="no export of sample at imgsz 640") as caught:
        open_detector(options)
    assert caught.value.hint == f"run `yolopipe export --artifacts-dir '{empty}'` first"
    assert not empty.exists()

    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=linked_root)
    (folder,) = linked_root.glob("*/imgsz640")
    monkeypatch.setattr(app.builder.export, "pin_spatial_dims", lambda *args: pytest.fail("exported again"))
    assert ensure_artifacts(options) == folder
    with open_detector(options) as det, open_detector(OpenOptions("sample", backend="onnxruntime")) as ref:
        assert det.meta == ref.meta and det.detect([bus])[0].width == ref.detect([bus])[0].width == 810


def test_a_model_pinned_to_the_square_runs_square_whatever_is_asked(sample_model_dir, tmp_path, bus):
    """An export from before rect inputs (H and W pinned to imgsz), opened as it is: the runtime
    reads from the model that it takes the square only and clamps the run to square, whose answers
    are those of the dynamic export run square, never a rect input it cannot take."""
    import shutil

    import onnx

    from app.builder.export import pin_spatial_dims
    from app.contracts import RunShape
    from app.runtime import OpenOptions, open_model_dir

    old = tmp_path / "old"
    old.mkdir()
    for name in ("meta.json", "weights.pt"):
        shutil.copyfile(sample_model_dir / name, old / name)
    onnx.save(pin_spatial_dims(onnx.load(str(sample_model_dir / "model.onnx")), 640), str(old / "model.onnx"))
    square = OpenOptions(backend="onnxruntime", shape=RunShape(letterbox="square"))
    with open_model_dir(old, OpenOptions(backend="onnxruntime")) as pinned, \
            open_model_dir(sample_model_dir, square) as sq:
        assert (pinned.shape.letterbox, pinned.pipeline.letterbox) == ("square", "square")
        square_rows = sq.run([bus]).rows.tobytes()
        assert pinned.run([bus]).rows.tobytes() == square_rows
    with open_model_dir(sample_model_dir, OpenOptions(backend="onnxruntime")) as rect:
        assert rect.shape.letterbox == "rect" and rect.run([bus]).rows.tobytes() != square_rows
