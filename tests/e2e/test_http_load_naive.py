"""The HTTP benchmark's naive part, started the way ``bench/http_load.py`` starts it, answers:
the baseline every yolopipe figure is compared with must run (wrk itself is not needed)."""

from __future__ import annotations

import httpx

from bench.http_load import parse_args, start_naive


def test_the_benchmark_starts_the_naive_server_and_it_detects(tmp_path, assets_dir):
    args = parse_args(["--backend", "onnxruntime", "--naive-workers", "1"])
    server = start_naive(args, tmp_path)
    try:
        server.wait_ready(timeout=300)
        bus = (assets_dir / "bus.jpg").read_bytes()
        r = httpx.post(f"{server.url}/v1/detect", content=bus, headers={"content-type": "image/jpeg"}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["width"], body["height"]) == (810, 1080) and body["detections"]
        assert server.gpus == 0
    finally:
        server.stop()
