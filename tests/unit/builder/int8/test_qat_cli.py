"""``yolopipe calibrate --qat`` as a user runs it, on a tiny real YOLOv8 (yolov8n.yaml, 64 pixels):
distilled models installed with the report, video frames only or images of one size, too few
images refused with the number, and a calibration killed midway installing nothing."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from app.cli import ExitCode
from tests.int8_models import IMGSZ
from tests.videos import write_clip

CLI = [sys.executable, "-m", "app.cli", "calibrate", "--weights", "yolov8n.yaml", "--imgsz", str(IMGSZ)]
FINALS = ("model.int8.onnx", "model.int8-cpu.onnx", "int8_report.json")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """An artifacts root holding the tiny model's export (each command reuses it)."""
    from app.builder.export import export_onnx

    out = tmp_path_factory.mktemp("artifacts")
    export_onnx("yolov8n.yaml", imgsz=IMGSZ, artifacts_dir=out)
    return out


def model_dir(root: Path) -> Path:
    return next(root.glob(f"*/imgsz{IMGSZ}"))


def same_size_photos(folder: Path, count: int, assets_dir: Path) -> Path:
    """``count`` crops of bus.jpg and zidane.jpg, all 96×128 (images of one size)."""
    import cv2

    folder.mkdir(parents=True)
    photos = [cv2.imread(str(assets_dir / name)) for name in ("bus.jpg", "zidane.jpg")]
    rng = np.random.default_rng(0)
    for k in range(count):
        img = photos[k % 2]
        y, x = rng.integers(0, 200, 2)
        cv2.imwrite(str(folder / f"p{k:02d}.jpg"), cv2.resize(img[y : y + 300, x : x + 400], (128, 96)))
    return folder


def run(*args, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def digests(d: Path) -> dict[str, str]:
    return {name: hashlib.sha256((d / name).read_bytes()).hexdigest() for name in FINALS if (d / name).is_file()}


def test_qat_installs_the_distilled_models_with_the_report(root, tmp_path, assets_dir):
    images = same_size_photos(tmp_path / "photos", 28, assets_dir)
    proc = run("--images", str(images), "--artifacts-dir", str(root), "--holdout", "8", "--qat", "--qat-steps", "4",
               cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    said = " ".join(proc.stderr.split())
    for target in ("tensorrt", "cpu"):  # the estimate before, the outcome after
        assert f"{target} model: 4 distillation steps of" in said and "about" in said
        assert f"{target} model: 4 steps in" in said and "distillation loss" in said
    d = model_dir(root)
    report = json.loads((d / "int8_report.json").read_text())
    assert report["installed"] and set(report["qat"]) == {"tensorrt", "cpu"}
    for target, qat in report["qat"].items():
        assert qat["steps"] == 4 and qat["stopped_by"] == "steps" and qat["images"] == 20
        assert qat["ptq_f1"] is not None and qat["eval_loss_before"] >= 0
    assert sorted(p.name for p in d.iterdir() if p.is_file()) == sorted(
        ["model.onnx", "meta.json", "weights.pt", *FINALS])  # nothing staged or journalled is left


def test_video_frames_only(root, tmp_path, assets_dir):
    clip = write_clip(tmp_path / "videos" / "clip.avi", assets_dir, count=40)
    proc = run("--images", str(clip.parent), "--artifacts-dir", str(root), "--frames-per-video", "32", "--qat",
               "--qat-steps", "2", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert "32 of them video frames" not in proc.stderr  # 16 held out of the 32 frames
    report = json.loads((model_dir(root) / "int8_report.json").read_text())
    assert report["qat"]["cpu"]["images"] == 16 and all("#frame" in name for name in report["heldout_images"])


def test_too_few_images_for_distillation_names_the_number(root, tmp_path, assets_dir):
    images = same_size_photos(tmp_path / "few", 20, assets_dir)  # 10 held out, 10 left to distil on
    before = digests(model_dir(root))
    proc = run("--images", str(images), "--artifacts-dir", str(root), "--qat", cwd=tmp_path)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert "needs at least 16 calibration images" in " ".join(proc.stderr.split())
    assert digests(model_dir(root)) == before


def test_a_killed_calibration_installs_nothing(root, tmp_path, assets_dir):
    images = same_size_photos(tmp_path / "photos", 28, assets_dir)
    d = model_dir(root)
    before = digests(d)
    assert len(before) == 3  # installed by an earlier test of this module
    proc = subprocess.Popen([*CLI, "--images", str(images), "--artifacts-dir", str(root), "--holdout", "8", "--qat",
                             "--qat-steps", "100000", "--qat-minutes", "30"],
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True)
    seen, deadline = "", time.monotonic() + 900
    try:
        while "distillation steps" not in seen and time.monotonic() < deadline:  # mid-distillation
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen += line
        assert "distillation steps" in seen, seen
        assert any(p.name.endswith(".new.onnx") for p in d.iterdir())  # the new models exist, staged
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert digests(d) == before  # the installed models and report are the earlier run's, untouched
    from app.artifacts.int8 import int8_cpu_model_path

    assert hashlib.sha256(int8_cpu_model_path(d).read_bytes()).hexdigest() == before["model.int8-cpu.onnx"]
