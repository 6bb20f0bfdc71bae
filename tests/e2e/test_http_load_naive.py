"""The HTTP benchmark's baseline, ``bench/naive_server.py`` (FastAPI + Ultralytics ``predict`` per
request), started from its command line as ``bench/http_load.py`` starts it (CPU, one worker,
offline), answers: the baseline every yolopipe figure is compared with must run (wrk itself is
not needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from app.weights import resolve_weights
from tests.net import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]


def test_the_naive_server_starts_and_detects(tmp_path, assets_dir):
    port, log = free_port(), tmp_path / "naive_server.log"
    weights = resolve_weights("sample").path
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "naive_server.py"), "--weights", str(weights),
                                 "--port", str(port), "--workers", "1", "--device", "cpu"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "YOLO_OFFLINE": "1"}, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, log, timeout=300)
        bus = (assets_dir / "bus.jpg").read_bytes()
        r = httpx.post(f"{url}/v1/detect", content=bus, headers={"content-type": "image/jpeg"}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["width"], body["height"]) == (810, 1080) and body["detections"]
    finally:
        proc.terminate()
        proc.wait(30)
