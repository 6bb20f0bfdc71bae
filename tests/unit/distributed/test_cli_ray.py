"""``yolopipe predict --ray``'s own options: one name, one meaning (``--gpu-actors`` counts actors;
``--gpus`` is ``serve``'s device list and not a ``predict`` option)."""

from __future__ import annotations

import subprocess
import sys

from app.cli import ExitCode


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


def test_gpus_is_not_a_predict_option(tmp_path):
    proc = predict(tmp_path, "--ray", "--gpus", "1")
    assert proc.returncode == ExitCode.USAGE and "--gpus" in proc.stdout + proc.stderr
