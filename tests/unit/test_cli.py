"""Every command of ``yolopipe`` end to end, as a user runs it: output, exit status, no traceback.

The exit-status table is ``app.cli.terminal.ExitCode``; each status is reached here by a real mistake.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli.terminal import ExitCode

CLI = [sys.executable, "-m", "app.cli"]


def run_cli(*args, cwd, env=None, timeout=600):
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def test_version(tmp_path):
    from importlib.metadata import version

    proc = run_cli("--version", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK and proc.stdout.strip() == f"yolopipe {version('yolopipe')}"


def test_help_explains_every_command_and_the_exit_statuses(tmp_path):
    proc = run_cli("--help", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK
    text = " ".join(proc.stdout.split())
    for cmd in ("export", "calibrate", "build-engine", "serve", "predict", "bench"):
        assert cmd in text
    assert "Exit status: 0 success" in text and "130 interrupted" in text
    for cmd, option in [("predict", "--resume"), ("predict", "--coco"), ("export", "--artifacts-dir"),
                        ("calibrate", "--images"), ("build-engine", "--precision"), ("serve", "--port")]:
        proc = run_cli(cmd, "--help", cwd=tmp_path)
        assert proc.returncode == ExitCode.OK and option in proc.stdout, (cmd, proc.stdout)


@pytest.mark.parametrize("args, code, says", [
    (["predict", "missing-folder"], ExitCode.USAGE, "no images found"),
    (["predict", "samples", "--backend", "foo"], ExitCode.USAGE, "unknown backend 'foo'"),
    (["predict", "samples", "--precision", "int4"], ExitCode.USAGE, "unknown precision 'int4'"),
    (["predict", "samples", "--conf", "2"], ExitCode.USAGE, "conf must be within"),
    (["predict", "samples", "--max-det", "301"], ExitCode.USAGE, "max_det must be within [1, 300]"),
    (["predict", "samples", "--weights", "nothere.pt"], ExitCode.USAGE, "weights file not found: nothere.pt"),
    (["export", "--imgsz", "100"], ExitCode.USAGE, "multiple of 32"),
    (["calibrate", "--images", ".", "--method", "foo"], ExitCode.USAGE, "unknown calibration method 'foo'"),
    (["serve", "--max-batch", "0"], ExitCode.USAGE, "--max-batch"),
    (["predict"], ExitCode.USAGE, "Missing argument"),  # Click's own usage error: 2 as well
])
def test_each_mistake_has_its_exit_status_and_one_clear_line(tmp_path, args, code, says):
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert says in " ".join(proc.stderr.split()), proc.stderr


def test_build_engine_without_tensorrt(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here (tests/tensorrt builds engines)")
    proc = run_cli("build-engine", "--backend", "tensorrt", "--precision", "fp16", cwd=tmp_path)
    assert proc.returncode == ExitCode.UNAVAILABLE and "TensorRT is not installed" in proc.stderr, proc.stderr


def test_build_engine_on_a_machine_without_a_gpu(tmp_path):
    """auto: TensorRT, else the torch-cuda engine on a GPU; a CPU has none to build, and says what it runs."""
    import importlib.util

    from app.gpu.probe import cuda_device_count

    if cuda_device_count() or importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("this machine has a GPU or TensorRT")
    for args in ([], ["--backend", "torch-cuda"]):
        proc = run_cli("build-engine", *args, "--artifacts-dir", str(tmp_path / "a"), cwd=tmp_path)
        said = " ".join(proc.stderr.split())
        assert proc.returncode == ExitCode.UNAVAILABLE and ("no NVIDIA GPU" in said or "needs an NVIDIA GPU" in said), said
    assert not (tmp_path / "a").exists()  # refused before any export


def test_calibrate_counts_only_the_images_it_can_read(tmp_path, assets_dir):
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "good.jpg").write_bytes((assets_dir / "bus.jpg").read_bytes())
    (photos / "broken.jpg").write_bytes((assets_dir / "bus.jpg").read_bytes()[:200])
    (photos / "notes.jpg").write_text("not an image")
    proc = run_cli("calibrate", "--images", str(photos), "--artifacts-dir", str(tmp_path / "a"), cwd=tmp_path)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == ExitCode.USAGE and f"1 images and video frames in {photos} leave 1 for" in said, said
    assert "skipping" in said and "broken.jpg" in said and "notes.jpg" in said


def test_an_empty_folder_is_a_usage_error_not_success(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_cli("predict", str(tmp_path / "empty"), cwd=tmp_path)
    assert proc.returncode == ExitCode.USAGE and "no images found" in proc.stderr


def test_a_file_that_is_not_a_checkpoint(tmp_path):
    """One line naming the user's file and what is wrong: no temp path, no banner, no cut."""
    import zipfile

    text = tmp_path / "bad.pt"
    text.write_text("these are not weights\n" * 64)
    archive = tmp_path / "archive.pt"  # a zip, as torch.save writes, that torch cannot load
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("archive/data.pkl", "not a pickle")
    cases = [(text, "it is not the zip archive torch.save writes"), (archive, "torch could not load it")]
    for bad, why in cases:
        for cmd in (["export"], ["predict", "samples"]):
            proc = run_cli(*cmd, "--weights", str(bad), "--artifacts-dir", str(tmp_path / "a"), cwd=tmp_path)
            assert proc.returncode == ExitCode.USAGE, proc.stderr
            error, hint = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "hint:"))]
            assert error.startswith(f"error: {bad} is not an Ultralytics YOLO checkpoint") and why in error, error
            assert error.isascii() and error.endswith(")") and "/tmp" not in error.replace(str(tmp_path), ""), error
            assert hint.startswith("hint: pass a .pt saved by Ultralytics")
    assert not [p for p in (tmp_path / "a").rglob("*") if p.is_file()]


def test_gpu_backend_on_a_machine_without_one(tmp_path, artifacts_dir):
    from app.gpu.probe import cuda_device_count

    if cuda_device_count():
        pytest.skip("this machine has a GPU")
    proc = run_cli("predict", "samples", "--backend", "torch-cuda", "--artifacts-dir", str(artifacts_dir), cwd=tmp_path)
    assert proc.returncode == ExitCode.UNAVAILABLE and "needs an NVIDIA GPU" in proc.stderr


def test_export_then_predict_samples_from_any_folder(tmp_path, artifacts_dir, assets_dir):
    """Artifacts are found wherever the command runs; 'samples' names Ultralytics' example images."""
    (tmp_path / "elsewhere").mkdir()
    proc = run_cli("export", "--artifacts-dir", str(artifacts_dir), cwd=tmp_path / "elsewhere")
    assert proc.returncode == ExitCode.OK and "up to date" in proc.stderr
    out = tmp_path / "p.jsonl"
    proc = run_cli("predict", "samples", "--artifacts-dir", str(artifacts_dir), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    names = sorted(json.loads(line)["image"] for line in out.read_text().splitlines())
    assert names == sorted(p.name for p in assets_dir.iterdir() if p.suffix == ".jpg")
    assert list((tmp_path / "elsewhere").iterdir()) == []  # nothing written where it ran


def test_bench_lists_its_options_and_runs_from_any_folder(tmp_path, artifacts_dir):
    """The benchmark ships in the package: no source checkout needed, results where --out says."""
    proc = run_cli("bench", "--help", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK and proc.stdout.startswith("usage: yolopipe bench")
    for option in ("--batches", "--decoders", "--folder-images", "--artifacts-dir", "--skip"):
        assert option in proc.stdout
    assert run_cli("bench", "--batches", "x", cwd=tmp_path).returncode == ExitCode.USAGE
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "--cpu", "--quick", "--batches", "1", "--skip", "ultralytics,nms,folder,bare,fidelity",
                   "--artifacts-dir", str(artifacts_dir), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    result = json.loads(out.read_text())
    rows = {(r["backend"], r["input"], r["batch"]) for r in result["rows"]}
    assert rows == {("onnxruntime", "frames", 1), ("onnxruntime", "jpeg", 1)}
    assert result["machine"]["cpu"] and result["versions"]["onnxruntime"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


def test_calibrate_writes_both_models_and_its_report(tmp_path, sample_model_dir, assets_dir):
    """The whole command on a small folder (clear numbers need more images: the report says so)."""
    import shutil

    import cv2

    root = tmp_path / "artifacts"
    private = root / sample_model_dir.relative_to(sample_model_dir.parent.parent)
    shutil.copytree(sample_model_dir, private)
    images = tmp_path / "photos"
    images.mkdir()
    for name in ("bus.jpg", "zidane.jpg"):
        img = cv2.imread(str(assets_dir / name))
        for k, variant in enumerate([img, img[:, ::-1], cv2.resize(img, None, fx=0.5, fy=0.5), img[::2, ::2],
                                     cv2.convertScaleAbs(img, alpha=0.8), cv2.convertScaleAbs(img, alpha=1.2)]):
            cv2.imwrite(str(images / f"{Path(name).stem}_{k}.jpg"), variant)
    args = ["calibrate", "--images", str(images), "--artifacts-dir", str(root), "--holdout", "3",
            "--max-float-layers", "0", "--frames-per-video", "4"]
    proc = run_cli(*args, "--min-f1", "0.0", cwd=tmp_path, timeout=900)
    assert proc.returncode == ExitCode.OK, proc.stderr
    for name in ("model.int8.onnx", "model.int8-cpu.onnx", "int8_report.json"):
        assert (private / name).is_file() and f"wrote {private / name}" in " ".join(proc.stderr.split())
    report = json.loads((private / "int8_report.json").read_text())
    assert report["passed"] is True and report["installed"] is True
    assert sorted(tmp_path.iterdir()) == sorted([root, images])  # nothing written where it ran
    # The INT8 models were made from the export pinned to the square: the CPU one runs square,
    # whatever the run asks (the runtime clamps it); FP32 beside it runs rect.
    from app.runtime import OpenOptions, open_model_dir

    with open_model_dir(private, OpenOptions(backend="onnxruntime", precision="int8")) as int8:
        assert (int8.precision, int8.shape.letterbox, int8.pipeline.letterbox) == ("int8", "square", "square")
        (bus,) = int8.detect([(assets_dir / "bus.jpg").read_bytes()])
        assert int8.input_size(1080, 810) == (640, 640) and bus.error is None and len(bus.detections) > 0
    with open_model_dir(private, OpenOptions(backend="onnxruntime")) as fp32:
        assert fp32.shape.letterbox == "rect" and fp32.input_size(1080, 810) == (640, 480)

    # an impossible gate: the report is written, the models stay as they were, exit status 1
    before = (private / "model.int8.onnx").stat().st_mtime_ns
    proc = run_cli(*args, "--min-f1", "1.01", cwd=tmp_path, timeout=900)
    assert proc.returncode == ExitCode.INCOMPLETE and "not installed" in proc.stderr, proc.stderr
    assert (private / "model.int8.onnx").stat().st_mtime_ns == before

    few = tmp_path / "few"
    few.mkdir()
    shutil.copy(images / "bus_0.jpg", few / "bus_0.jpg")
    proc = run_cli("calibrate", "--images", str(few), "--artifacts-dir", str(root), cwd=tmp_path)
    assert proc.returncode == ExitCode.USAGE and "error:" in proc.stderr


def test_verbose_predict_lists_each_start_up_step_with_its_time_once(tmp_path, artifacts_dir):
    import re

    out = tmp_path / "p.jsonl"
    proc = run_cli("predict", "samples", "--verbose", "--out", str(out), "--artifacts-dir", str(artifacts_dir),
                   cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert proc.stderr.count("start-up, step by step:") == 1
    steps = {m[2]: float(m[1]) for m in re.finditer(r"^\s+(\d+\.\d+) s  (.+)$", proc.stderr, re.MULTILINE)}
    names = list(steps)
    assert names[0] == "starting Python and importing yolopipe", names
    assert "checking the model's export (a first run exports it)" in names and "opening ONNX Runtime" in names
    assert names[-2].startswith("the first batch") and names[-1] == "from the process start to the first results"
    assert 0 < max(v for k, v in steps.items() if k != names[-1]) <= steps[names[-1]]
    assert len(out.read_text().splitlines()) == 2
    quiet = run_cli("predict", "samples", "--out", str(out), "--artifacts-dir", str(artifacts_dir), cwd=tmp_path)
    assert quiet.returncode == ExitCode.OK and "step by step" not in quiet.stderr


def test_serve_moved_with_port_alone_names_a_taken_grpc_port_in_one_line(tmp_path):
    """gRPC's port is --port + 1 unless given: a server moved with --port alone does not take
    another's 8001; when that port is taken, one line says which and how to choose another."""
    import os

    from tests.net import taken_port

    env = {k: v for k, v in os.environ.items() if k != "YOLOPIPE_GRPC_PORT"}  # tests/conftest.py sets it
    proc = run_cli("serve", "--backend", "onnxruntime", "--port", "65535", cwd=tmp_path, env=env)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert "--grpc-port" in proc.stderr and "--port + 1 = 65536" in " ".join(proc.stderr.split()), proc.stderr
    listener, grpc_port = taken_port()
    with listener:
        proc = run_cli("serve", "--backend", "onnxruntime", "--host", "127.0.0.1", "--port", str(grpc_port - 1),
                       cwd=tmp_path, env=env)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert " ".join(" ".join(lines).split()) == (
        f"error: cannot listen on 127.0.0.1:{grpc_port}: Address already in use (the gRPC port, --port + 1 by "
        "default); choose another with --grpc-port N, or --grpc-port 0 for no gRPC"), proc.stderr
