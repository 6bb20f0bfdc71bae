"""``yolopipe calibrate`` as a user runs it, in a process of its own, on a tiny real YOLOv8
(yolov8n.yaml, random weights, 64 pixels): video frames only, and a calibration killed midway
installing nothing (calibration/README.md, "What it writes")."""

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

from app.cli.terminal import ExitCode
from tests.videos import write_clip

IMGSZ = 64
CLI = [sys.executable, "-m", "app.cli", "calibrate", "--weights", "yolov8n.yaml", "--imgsz", str(IMGSZ)]
FINALS = ("model.int8.onnx", "model.int8-cpu.onnx", "int8_report.json")
# Printed by accuracy control once both new models are staged, before it measures 16 Convs one by
# one on 8 held-out images and scores the model again: seconds before the install.
SENSITIVITY_LINE = "tensorrt model: measuring the sensitivity of"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """An artifacts root holding the tiny model's export (each command reuses it)."""
    from app.builder.export import export_onnx

    out = tmp_path_factory.mktemp("artifacts")
    export_onnx("yolov8n.yaml", imgsz=IMGSZ, artifacts_dir=out)
    return out


def model_dir(root: Path) -> Path:
    return next(root.glob(f"*/imgsz{IMGSZ}"))


def photos(folder: Path, count: int, assets_dir: Path, seed: int) -> Path:
    """``count`` 96×128 crops of bus.jpg and zidane.jpg, where ``seed`` says."""
    import cv2

    folder.mkdir(parents=True)
    sources = [cv2.imread(str(assets_dir / name)) for name in ("bus.jpg", "zidane.jpg")]
    rng = np.random.default_rng(seed)
    for k in range(count):
        img = sources[k % 2]
        y, x = rng.integers(0, 200, 2)
        cv2.imwrite(str(folder / f"p{k:02d}.jpg"), cv2.resize(img[y : y + 300, x : x + 400], (128, 96)))
    return folder


def run(*args, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, check=False)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests(d: Path) -> dict[str, str]:
    return {name: sha256(d / name) for name in FINALS if (d / name).is_file()}


def test_video_frames_only(root, tmp_path, assets_dir):
    clip = write_clip(tmp_path / "videos" / "clip.avi", assets_dir, count=40)
    proc = run("--images", str(clip.parent), "--artifacts-dir", str(root), "--frames-per-video", "32", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    said = " ".join(proc.stderr.split())
    assert "calibrating on 16 images (16 of them video frames), 16 held out for the report" in said
    report = json.loads((model_dir(root) / "int8_report.json").read_text())
    assert report["installed"] and report["calibration_images"] == 16
    assert len(report["heldout_images"]) == 16 and all("#frame" in name for name in report["heldout_images"])


def test_a_killed_calibration_installs_nothing(root, tmp_path, assets_dir):
    """SIGKILL between staging the new models and installing them: the earlier install stays whole.

    ``--target-f1 1.01`` (no F1 interval reaches it) makes accuracy control run, and the test
    stops the process group (SIGSTOP) on the line accuracy control prints before its layer
    measurements, so the calibration is held there, before the install, while the test looks at
    the folder; then it is killed."""
    d = model_dir(root)
    first = run("--images", str(photos(tmp_path / "first", 28, assets_dir, seed=0)), "--artifacts-dir", str(root),
                "--holdout", "8", cwd=tmp_path)
    assert first.returncode == ExitCode.OK, first.stderr
    before = digests(d)
    assert len(before) == 3
    images = photos(tmp_path / "second", 28, assets_dir, seed=1)  # other images: other ranges, other models
    proc = subprocess.Popen([*CLI, "--images", str(images), "--artifacts-dir", str(root), "--holdout", "8",
                             "--target-f1", "1.01"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    seen, deadline = "", time.monotonic() + 600
    try:
        while SENSITIVITY_LINE not in seen and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen += line
        assert SENSITIVITY_LINE in seen, seen
        os.killpg(proc.pid, signal.SIGSTOP)
        staged = sorted(p.name for p in d.iterdir() if ".new." in p.name)
        assert staged == ["model.int8-cpu.new.onnx", "model.int8.new.onnx"]  # both new models, not yet the report
        assert sha256(d / "model.int8.new.onnx") != before["model.int8.onnx"]
        assert sha256(d / "model.int8-cpu.new.onnx") != before["model.int8-cpu.onnx"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert digests(d) == before  # the installed models and report are the earlier run's, untouched
    from app.artifacts.int8 import int8_cpu_model_path

    assert sha256(int8_cpu_model_path(d)) == before["model.int8-cpu.onnx"]  # a reader finds the earlier install


def test_distillation_on_installs_the_model_its_report_says_it_kept(root, tmp_path, assets_dir):
    """``--distill on`` on the CPU: both models distilled for a few seconds, each scored against the
    PTQ model on the held-out images; the report names the one installed, and the installed
    model's figures are that one's."""
    proc = run("--images", str(photos(tmp_path / "photos", 40, assets_dir, seed=2)), "--artifacts-dir", str(root),
               "--holdout", "8", "--distill", "on", "--distill-minutes", "0.1", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    report = json.loads((model_dir(root) / "int8_report.json").read_text())
    distillation = report["distillation"]
    assert distillation["ran"] and distillation["mode"] == "on" and set(distillation["models"]) == {"tensorrt", "cpu"}
    installed = {"tensorrt": report, "cpu": report["cpu_variant"]}
    for target, outcome in distillation["models"].items():
        assert outcome["kept"] in ("distilled", "ptq")
        assert outcome["training"]["device"] == "cpu" and outcome["training"]["steps"] > 0
        kept = outcome[outcome["kept"]]
        assert round(installed[target]["f1"], 4) == kept["f1"]
        assert installed[target]["mean_score_drift"] == pytest.approx(kept["mean_score_drift"], abs=1e-5)
        assert f"{target} model: distilled" in " ".join(proc.stderr.split())


@pytest.mark.parametrize(("args", "said"), [
    (("--distill", "sometimes"), "unknown --distill 'sometimes'; choose one of auto, on, off"),
    (("--distill-minutes", "0"), "--distill-minutes must be positive, got 0.0"),
])
def test_bad_distillation_options_are_usage_errors(tmp_path, args, said):
    proc = run("--images", str(tmp_path), *args, cwd=tmp_path, timeout=120)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert said in " ".join(proc.stderr.split())
