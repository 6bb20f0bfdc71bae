"""Live RTSP on loopback: Debian's ffmpeg publishes an H.264 clip (at its own rate, looping) to an
RTSP server (Debian's rtsp-server-perl: Debian 12's ffmpeg has no RTSP server mode), and the
streams runner reads it like a camera. A source that dies mid-run reconnects when it is back,
and the other stream never stops meanwhile. And a live HTTP source (ffmpeg serving MPEG-TS)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import threading
import time

import pytest

from app.contracts import RunShape
from app.predict.streams import StreamRunner
from app.runtime import OpenOptions, open_detector
from tests.net import free_port
from tests.videos import CLIP_SIZE, ffmpeg, write_clip, write_h264

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(ffmpeg() is None or shutil.which("rtsp-server-perl") is None,
                       reason="needs ffmpeg and rtsp-server-perl (apt-get install ffmpeg rtsp-server-perl; .ci/run does)"),
]


@pytest.fixture(scope="module")
def clip(tmp_path_factory, assets_dir):
    root = tmp_path_factory.mktemp("rtsp")
    return write_h264(root / "clip.mp4", write_clip(root / "clip.avi", assets_dir, 20))


class RtspServer:
    def __init__(self) -> None:
        self.client_port, self.source_port = free_port(), free_port()
        self.proc = subprocess.Popen(
            ["rtsp-server-perl", "-c", str(self.client_port), "-s", str(self.source_port),
             "--client_listen_address", "127.0.0.1", "--source_listen_address", "127.0.0.1",
             "--rtp_start_port", str(random.randrange(20000, 60000, 100)), "-l", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.source_port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "rtsp-server-perl did not start"
                time.sleep(0.1)

    def url(self, name: str) -> str:
        return f"rtsp://127.0.0.1:{self.client_port}/{name}"

    def publish(self, clip, name: str) -> subprocess.Popen:
        """ffmpeg sending ``clip`` in a loop at its own frame rate, as a camera would."""
        return subprocess.Popen(
            [ffmpeg(), "-v", "error", "-re", "-stream_loop", "-1", "-i", str(clip), "-c", "copy", "-f", "rtsp",
             f"rtsp://127.0.0.1:{self.source_port}/{name}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_killed_rtsp_source_reconnects_and_the_other_never_stops(clip, artifacts_dir, monkeypatch):
    # OpenCV asks for RTP over TCP; this small server only sends RTP over UDP (loopback: lossless).
    monkeypatch.setenv("OPENCV_FFMPEG_CAPTURE_OPTIONS", "rtsp_transport;udp")
    server = RtspServer()
    cams = {"cam1": server.publish(clip, "cam1"), "cam2": server.publish(clip, "cam2")}
    frames: dict[str, list] = {}
    lock = threading.Lock()

    def on_frames(batch, answers, track_ids):
        with lock:
            for frame, result in zip(batch, answers.results()):
                frames.setdefault(frame.stream.id, []).append((frame.index, result))

    def count(stream_id: str) -> int:
        with lock:
            return len(frames.get(stream_id, []))

    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=4))
    with open_detector(options) as detector:
        runner = StreamRunner(detector, detector.params(), on_frames)
        thread = threading.Thread(target=runner.run, kwargs={"until_done": False}, daemon=True)
        thread.start()
        try:
            time.sleep(1.0)  # let the publishers announce
            one = runner.add(server.url("cam1"), stream_id="cam1")
            two = runner.add(server.url("cam2"), stream_id="cam2")
            wait_for(lambda: count("cam1") >= 10 and count("cam2") >= 10, 60, "frames from both cameras")

            stop(cams.pop("cam1"))  # the first camera dies mid-run
            wait_for(lambda: one.state == "reconnecting", 30, "cam1 to notice")
            during = count("cam2")
            wait_for(lambda: count("cam2") >= during + 10, 30, "cam2 to go on while cam1 is down")

            cams["cam1"] = server.publish(clip, "cam1")  # and comes back
            before = count("cam1")
            wait_for(lambda: count("cam1") >= before + 10, 60, "cam1 to reconnect")
            assert one.state == "live" and one.stats.reconnects >= 1
            assert two.stats.reconnects == 0
        finally:
            runner.stop()
            thread.join(timeout=30)
            for proc in cams.values():
                stop(proc)
            server.close()
    with lock:
        results = [r for _, r in frames["cam1"] + frames["cam2"]]
    assert all((r.width, r.height) == CLIP_SIZE and r.error is None for r in results)
    assert sum(len(r.detections) > 0 for r in results) >= 0.9 * len(results)  # people in the clip's frames
    indexes = [i for i, _ in frames["cam2"]]
    assert indexes == sorted(indexes)  # frames of a stream come out in their order


@pytest.mark.skipif(ffmpeg() is None, reason="needs ffmpeg")
def test_a_live_http_source_is_read_as_a_camera(clip, artifacts_dir):
    """ffmpeg serving MPEG-TS over HTTP at the clip's own rate (``-listen 1``): a live source."""
    port = free_port()
    server = subprocess.Popen(
        [ffmpeg(), "-v", "error", "-re", "-stream_loop", "-1", "-i", str(clip), "-c", "copy", "-f", "mpegts",
         "-listen", "1", f"http://127.0.0.1:{port}/cam.ts"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: list = []
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=4))
    with open_detector(options) as detector:
        runner = StreamRunner(detector, detector.params(),
                              lambda batch, answers, ids: seen.extend(zip(batch, answers.results())))
        thread = threading.Thread(target=runner.run, kwargs={"until_done": False}, daemon=True)
        thread.start()
        try:
            time.sleep(0.5)
            stream = runner.add(f"http://127.0.0.1:{port}/cam.ts")
            assert stream.live and stream.drops
            wait_for(lambda: len(seen) >= 10, 60, "frames over HTTP")
        finally:
            runner.stop()
            thread.join(timeout=30)
            stop(server)
    assert all(r.error is None and (r.width, r.height) == CLIP_SIZE for _, r in seen)
    assert [f.index for f, _ in seen] == sorted(f.index for f, _ in seen)
