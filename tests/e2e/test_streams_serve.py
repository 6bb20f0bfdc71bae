"""``/v1/streams`` on a real ``yolopipe serve`` (CPU backend): add a stream, read its events over
SSE (each one the frame's detections, equal to ``predict`` on that frame), see it in the list
and in /metrics, remove it; sources the server must not open are refused with one clear error."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

from app.contracts import RunShape
from app.runtime import OpenOptions, open_detector
from tests.net import free_port, wait_ready
from tests.references import detections_json
from tests.videos import CLIP_FPS, decoded_frames, write_clip

CLI = [sys.executable, "-m", "app.cli"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory, artifacts_dir, assets_dir):
    import os

    videos = tmp_path_factory.mktemp("served")
    write_clip(videos / "clip.avi", assets_dir, 40)  # 4 s at 10 fps
    port = free_port()
    log = videos / "server.log"
    env = {**os.environ, "YOLOPIPE_ARTIFACTS_DIR": str(artifacts_dir), "YOLO_OFFLINE": "1",
           "YOLOPIPE_STREAM_FILES_ROOT": str(videos), "YOLOPIPE_MAX_STREAMS": "2", "YOLOPIPE_WORKERS": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([*CLI, "serve", "--backend", "onnxruntime", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, log)
    yield base, videos
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sse_events(base: str, stream_id: str, timeout: float = 60.0) -> list[tuple[str, dict]]:
    events, kind = [], "message"
    with httpx.stream("GET", f"{base}/v1/streams/{stream_id}/events", timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
                if kind == "end":
                    break
                kind = "message"
    return events


def test_a_stream_added_at_runtime_gives_one_event_per_frame(server, artifacts_dir):
    base, videos = server
    r = httpx.post(f"{base}/v1/streams", json={"source": "clip.avi"}, timeout=30)
    assert r.status_code == 201, r.text
    stream_id = r.json()["id"]
    listed = httpx.get(f"{base}/v1/streams", timeout=30).json()["streams"]
    assert [s["id"] for s in listed] == [stream_id]

    events = sse_events(base, stream_id)
    frames = [e for kind, e in events if kind == "message"]
    assert events[-1][0] == "end" and len(frames) >= 3  # subscribed while the clip was playing
    indexes = [e["frame"] for e in frames]
    assert indexes == sorted(indexes) and all(e["time_s"] == round(e["frame"] / CLIP_FPS, 6) for e in frames)
    decoded = decoded_frames(videos / "clip.avi")
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=4))
    with open_detector(options) as det:
        reference = det.detect([decoded[i] for i in indexes[:8]], det.params())
        assert [e["detections"] for e in frames[:8]] == [detections_json(ref.detections, det.names) for ref in reference]

    snap = httpx.get(f"{base}/v1/streams/{stream_id}", timeout=30).json()
    assert snap["state"] == "ended" and snap["frames"] >= len(frames)
    assert snap["frames"] + snap["dropped"] == 40  # played as a camera: each frame processed or dropped, newest win
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    assert 'yolopipe_stream_fps{' in metrics and f'stream="{stream_id}"' in metrics
    assert httpx.delete(f"{base}/v1/streams/{stream_id}", timeout=30).status_code == 204
    assert httpx.get(f"{base}/v1/streams/{stream_id}", timeout=30).status_code == 404
    assert httpx.delete(f"{base}/v1/streams/{stream_id}", timeout=30).status_code == 404


@pytest.mark.parametrize("source", ["/etc/passwd", "../server.log", "file:///etc/passwd", "-i x",
                                    "concat:clip.avi|clip.avi", "missing.avi"])
def test_sources_the_server_must_not_open_are_refused(server, source):
    r = httpx.post(f"{server[0]}/v1/streams", json={"source": source}, timeout=30)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_parameter"


def test_the_number_of_streams_is_bounded(server):
    base, _ = server
    ids = []
    try:
        for _ in range(2):
            r = httpx.post(f"{base}/v1/streams", json={"source": "rtsp://127.0.0.1:9/none"}, timeout=30)
            assert r.status_code == 201
            ids.append(r.json()["id"])
        r = httpx.post(f"{base}/v1/streams", json={"source": "rtsp://127.0.0.1:9/none"}, timeout=30)
        assert r.status_code == 422 and "at most 2 streams" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/streams/{ids[0]}", timeout=30).json()["state"] in ("connecting", "reconnecting")
    finally:
        for stream_id in ids:
            httpx.delete(f"{base}/v1/streams/{stream_id}", timeout=30)
    assert httpx.get(f"{base}/v1/streams/9-0", timeout=30).status_code == 404
