"""``yolopipe predict --ray``'s own options: ``--gpu-actors`` and ``--cpu-actors`` count actors
and reach the Ray job as given, with the detector ``predict`` opens (its ``OpenOptions``, built by
the one function files and streams use); without ``--ray`` they are refused before anything runs.
On a machine, ``predict --ray`` prints no line of Ray's own."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

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
            "--classes", "1", "--no-batch-invariant", "--device", "1", "--square"]
    result = CliRunner().invoke(cli, ["predict", "s3://bucket/photos", "--out", str(tmp_path / "p.jsonl"), *args])
    assert result.exit_code == ExitCode.OK, result.output
    (kwargs,) = calls
    options = kwargs["options"]
    assert (options.backend, options.imgsz, options.device, options.batch_invariant) == ("onnxruntime", 320, 1, False)
    assert options.shape == RunShape(max_batch=6, decode="opencv", letterbox="square")  # shipped to the actors
    assert kwargs["detect"] == {"conf": 0.5, "iou": 0.7, "max_det": 300, "classes": [1], "agnostic": False}


# Ray's own log lines: a worker's forwarded output "(pid=...)" or "(MapWorker pid=...)", its C++
# core's "[date time E pid tid]", its Python loggers' "date time<TAB>WARNING file.py:n --".
RAY_LINE = re.compile(r"\bpid=\d+|^\[\d{4}-\d\d-\d\d [\d:,]+ [DIWEF] \d+|\t(DEBUG|INFO|WARNING|ERROR) \S+\.py:\d+ --|RayDeprecation")


def test_predict_with_ray_prints_no_line_of_rays_own(tmp_path, artifacts_dir, assets_dir):
    """``predict --ray`` on two photos, Ray started by the command: the terminal shows the progress
    and the summary, no line of Ray's; the records are ``predict``'s, and the line of Ray's core
    about the actors' arguments (ray-project/ray#53727) is in the session's logs instead."""
    pytest.importorskip("ray")
    ray_tmp = Path(tempfile.mkdtemp(prefix="yp-ray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    try:
        common = ["predict", str(assets_dir), "--backend", "onnxruntime", "--batch", "2", "--artifacts-dir",
                  str(artifacts_dir)]
        env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
        env.pop("RAY_ADDRESS", None)
        ray = subprocess.run([sys.executable, "-m", "app.cli", *common, "--ray", "--out", str(tmp_path / "ray.jsonl")],
                             capture_output=True, text=True, timeout=300, env=env, check=False)
        assert ray.returncode == ExitCode.OK, ray.stderr
        assert [line for line in (ray.stderr + ray.stdout).splitlines() if RAY_LINE.search(line)] == []
        assert "2 images, 6 detections, 0 errors" in ray.stderr
        log = ray_tmp / "ray" / "session_latest" / "logs" / "yolopipe-driver.err"
        assert "ray-project/ray/issues/53727" in log.read_text()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    alone = subprocess.run([sys.executable, "-m", "app.cli", *common, "--out", str(tmp_path / "p.jsonl")],
                           capture_output=True, text=True, timeout=300, check=False)
    assert alone.returncode == ExitCode.OK, alone.stderr
    by_image = lambda path: sorted(path.read_text().splitlines(), key=lambda line: json.loads(line)["image"])
    assert by_image(tmp_path / "ray.jsonl") == by_image(tmp_path / "p.jsonl")
