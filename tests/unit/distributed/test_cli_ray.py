"""``yolopipe predict --ray``'s own options: ``--gpu-actors`` and ``--cpu-actors`` count actors
and reach the Ray job as given, with the detector ``predict`` opens (its ``OpenOptions``, built by
the one function files and streams use); without ``--ray`` they are refused before anything runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.cli.terminal import ExitCode
from app.records import FolderSummary


def predict(tmp_path, *args):
    proc = subprocess.run([sys.executable, "-m", "app.cli", "predict", "samples", "--out", str(tmp_path / "p.jsonl"),
                           *args], check=False, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def test_ray_options_need_ray(tmp_path):
    proc = predict(tmp_path, "--gpu-actors", "1")
    assert proc.returncode == ExitCode.USAGE, proc.stdout + proc.stderr
    assert "--gpu-actors, --cpu-actors and --format need --ray" in proc.stdout + proc.stderr
    assert not (tmp_path / "p.jsonl").exists()


@pytest.mark.parametrize("args, actors", [
    (["--gpu-actors", "2"], {"gpu_actors": 2, "cpu_actors": None}),
    (["--gpu-actors", "0", "--cpu-actors", "3"], {"gpu_actors": 0, "cpu_actors": 3}),
    ([], {"gpu_actors": None, "cpu_actors": None}),  # the job's default: every GPU of the cluster
])
def test_the_actor_counts_reach_the_ray_job_as_given(tmp_path, monkeypatch, args, actors):
    import app.distributed

    calls = []

    def job(source, out, **kwargs):
        calls.append((source, out, kwargs))
        return FolderSummary(images=3, detections=7)

    monkeypatch.setattr(app.distributed, "predict_with_ray", job)
    out = tmp_path / "p.jsonl"
    result = CliRunner().invoke(cli, ["predict", "s3://bucket/photos", "--ray", "--out", str(out), *args])
    assert result.exit_code == ExitCode.OK, result.output
    ((source, written, kwargs),) = calls
    assert source == "s3://bucket/photos" and written == out
    assert {k: kwargs[k] for k in actors} == actors
    assert "3 images, 7 detections, 0 errors" in result.output


def test_the_ray_job_gets_the_detector_predict_opens(tmp_path, monkeypatch):
    import app.distributed
    from app.contracts import RunShape

    calls = []

    def job(source, out, **kwargs):
        calls.append(kwargs)
        return FolderSummary()

    monkeypatch.setattr(app.distributed, "predict_with_ray", job)
    args = ["--ray", "--backend", "onnxruntime", "--batch", "6", "--imgsz", "320", "--decode", "cpu", "--conf", "0.5",
            "--classes", "1", "--no-batch-invariant", "--device", "1"]
    result = CliRunner().invoke(cli, ["predict", "s3://bucket/photos", "--out", str(tmp_path / "p.jsonl"), *args])
    assert result.exit_code == ExitCode.OK, result.output
    (kwargs,) = calls
    options = kwargs["options"]
    assert (options.backend, options.imgsz, options.device, options.batch_invariant) == ("onnxruntime", 320, 1, False)
    assert options.shape == RunShape(max_batch=6, decode="opencv")
    assert kwargs["detect"] == {"conf": 0.5, "iou": 0.7, "max_det": 300, "classes": [1], "agnostic": False}

