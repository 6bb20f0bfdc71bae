"""Many sources at once (``app.predict.streams``) on files: frames of every stream share
batches, results equal ``predict`` on the same video, files never drop, live-paced ones keep
their newest frames, a bad source stays alone, and streams come and go while others run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import cv2
import pytest

from app.contracts import RunShape
from app.pipeline.detector import Detector
from app.predict import stream_source
from app.predict.folder import predict_folder
from app.predict.streams import LIVE_BUFFER, StreamRunner, predict_streams, read_source_list
from app.runtime import OpenOptions, open_detector
from tests.references import detections_json
from tests.stalls import StallWatch
from tests.standins import Answers
from tests.videos import clip_frames, write_clip

CLI = [sys.executable, "-m", "app.cli"]


@pytest.fixture(scope="module")
def detector(artifacts_dir):
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=8))
    with open_detector(options) as det:
        yield det


@pytest.fixture(scope="module")
def clips(tmp_path_factory, assets_dir):
    root = tmp_path_factory.mktemp("clips")
    return [write_clip(root / "a.avi", assets_dir, 12), write_clip(root / "b.avi", assets_dir, 8)]


@pytest.fixture(scope="module")
def per_video(detector, clips, tmp_path_factory):
    """What ``predict`` writes for each clip alone: the reference for the streams."""
    out = {}
    for clip in clips:
        path = tmp_path_factory.mktemp("ref") / "out.jsonl"
        predict_folder(detector, str(clip), path, detector.params())
        out[str(clip)] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


class RecordingRunner(StreamRunner):
    """Notes which streams each batch held (the runner's own batches, unchanged)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[list[str]] = []

    def _detect(self, frames):
        self.batches.append([f.stream.id for f in frames])
        return super()._detect(frames)


def test_files_as_streams_equal_predict_and_share_batches(detector, clips, per_video):
    got: dict[str, list] = {}

    def on_frames(frames, answers, track_ids):
        for k, frame in enumerate(frames):
            got.setdefault(frame.stream.source, []).append(
                (frame.index, detections_json(answers.detections(k), detector.names)))

    runner = RecordingRunner(detector, detector.params(), on_frames, max_wait_ms=200)
    streams = [runner.add(str(c)) for c in clips]
    runner.run(until_done=True)
    for clip in clips:
        ref = per_video[str(clip)]
        assert got[str(clip)] == [(r["frame"], r["detections"]) for r in ref]  # every frame, in order, equal
    assert [s.stats.dropped for s in streams] == [0, 0]  # a file read as fast as possible never drops
    assert [s.state for s in streams] == ["ended", "ended"]
    assert any(len(set(b)) == 2 for b in runner.batches), runner.batches  # frames of both in one batch
    assert max(len(b) for b in runner.batches) <= 8


def test_a_realtime_file_keeps_its_newest_frames_and_counts_drops(detector, clips):
    runner = StreamRunner(detector, detector.params(), lambda *a: None)
    stream = runner.add(str(clips[0]), realtime=True)  # paced at 10 fps like a camera; nobody takes frames
    stream.join(timeout=30)
    kept = stream.take(100)
    assert [f.index for f in kept] == list(range(12 - LIVE_BUFFER, 12))  # newest win
    assert stream.stats.dropped == 12 - LIVE_BUFFER and stream.snapshot()["dropped"] == 12 - LIVE_BUFFER
    runner.stop()


def test_a_bad_source_fails_alone(detector, clips, per_video, tmp_path):
    written: list[str] = []
    summary = predict_streams(detector, [str(tmp_path / "missing.mp4"), str(clips[1])], written.append,
                              detector.params())
    lines = [json.loads(line) for line in written]
    good = [r for r in lines if r["stream"] == "1"]
    assert [r["frame"] for r in good] == [r["frame"] for r in per_video[str(clips[1])]]
    (bad,) = [r for r in lines if r["stream"] == "0"]
    assert "cannot open" in bad["error"]
    assert len(summary.failed) == 1 and summary.frames == 8


def test_streams_come_and_go_while_others_run(detector, clips):
    frames: dict[str, int] = {}
    lock = threading.Lock()

    def on_frames(batch, answers, track_ids):
        with lock:
            for frame in batch:
                frames[frame.stream.id] = frames.get(frame.stream.id, 0) + 1

    runner = StreamRunner(detector, detector.params(), on_frames, max_streams=3)
    thread = threading.Thread(target=runner.run, kwargs={"until_done": False}, daemon=True)
    thread.start()
    try:
        first = runner.add(str(clips[0]), realtime=True)
        wait_for(lambda: frames.get(first.id, 0) >= 2)
        second = runner.add(str(clips[1]))
        wait_for(lambda: frames.get(second.id, 0) == 8)  # a whole file, added under load
        assert runner.remove(first.id) and runner.get(first.id) is None
        third = runner.add(str(clips[1]))
        wait_for(lambda: frames.get(third.id, 0) == 8)
        assert second.stats.dropped == 0 and third.stats.dropped == 0
        assert not runner.remove("no-such-stream")
    finally:
        runner.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_source_lists_follow_ultralytics_habits(tmp_path):
    listing = tmp_path / "cams.streams"
    listing.write_text("# cameras\nrtsp://10.0.0.1/a\n\n  /data/b.mp4  \n")
    assert read_source_list(str(listing)) == ["rtsp://10.0.0.1/a", "/data/b.mp4"]
    assert read_source_list("rtsp://10.0.0.1/a") == ["rtsp://10.0.0.1/a"]


def test_cli_streams_from_a_list_to_stdout(clips, tmp_path, artifacts_dir):
    listing = tmp_path / "two.txt"
    listing.write_text(f"{clips[0]}\n{clips[1]}\n")
    proc = subprocess.run([*CLI, "predict", str(listing), "--out", "-", "--track", "--vid-stride", "2"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    by_stream = {s: [r["frame"] for r in records if r["stream"] == s] for s in ("0", "1")}
    assert by_stream == {"0": list(range(0, 12, 2)), "1": list(range(0, 8, 2))}
    assert all("track_id" in d for r in records for d in r["detections"])
    assert "2 streams, 10 frames" in proc.stderr


def test_a_source_of_frames_over_the_pixel_limit_fails_alone(detector, clips, per_video, tmp_path):
    """Its frame size is read on opening, before any frame is queued (a camera of giant frames
    would otherwise fill the stream's buffer with them); the other stream runs as it would alone."""
    import cv2
    import numpy as np

    big = tmp_path / "big.avi"
    writer = cv2.VideoWriter(str(big), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (800, 600))
    for k in range(3):
        writer.write(np.full((600, 800, 3), 40 * k, np.uint8))
    writer.release()
    limited = detector.reshaped(max_pixels=800 * 600 - 1)  # clips[1] is 640x480: under it
    written: list[str] = []
    summary = predict_streams(limited, [str(big), str(clips[1])], written.append, detector.params())
    lines = [json.loads(line) for line in written]
    good = [r for r in lines if r["stream"] == "1"]
    assert [r["frame"] for r in good] == [r["frame"] for r in per_video[str(clips[1])]]
    (bad,) = [r for r in lines if r["stream"] == "0"]
    assert "has frames of 800x600 pixels, over the limit of 479,999 per image" in bad["error"]
    assert len(summary.failed) == 1 and summary.frames == 8


@pytest.fixture(scope="module")
def clip30(tmp_path_factory, assets_dir):
    """1.5 s of 320x240 at 30 fps in MPEG-4 Part 2 (OpenCV writes it everywhere, FFmpeg decodes
    it with threads, and cheaply, so the pacing is what is seen)."""
    path = tmp_path_factory.mktemp("clip30") / "clip30.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 30.0, (320, 240))
    for frame in clip_frames(assets_dir, 45):
        writer.write(cv2.resize(frame, (320, 240)))
    writer.release()
    return path


def test_paced_streams_keep_their_source_rate(clip30):
    """Four files read as cameras at 30 fps, the model a fast stand-in: every stream is read at
    its own rate, and every frame is processed (none dropped)."""
    answers = Answers(max_batch=8, per_batch_s=0.002)
    detector = Detector(answers)
    runner = StreamRunner(detector, detector.params(), lambda *a: None, max_streams=4)
    t0 = time.monotonic()
    with StallWatch() as watch:
        streams = [runner.add(str(clip30), realtime=True) for _ in range(4)]
        runner.run(until_done=True)
    wall = time.monotonic() - t0
    assert [s.state for s in streams] == ["ended"] * 4
    for s in streams:
        assert s.fps == 30.0 and s.stats.frames_read == 45
        assert s.stats.frames_done + s.stats.dropped == 45, s.snapshot()
        # a drop only where this process went a frame's time without running (a loaded machine)
        assert s.stats.dropped == 0 or watch.longest_s >= 1 / 30.0, (s.snapshot(), watch.longest_s)
    assert 45 / 30.0 <= wall < 45 / 30.0 / 0.85 + 1.0, wall  # paced: not faster than the source, not far behind


def test_opencv_captures_share_the_cores(clip30, monkeypatch):
    """Each OpenCV capture of a runner decodes with its share of the machine's cores, not
    FFmpeg's default of one thread per core each (32 captures on 16 cores: 512 threads, and the
    threads that run the model get what is left)."""
    threads: list[int] = []
    real = stream_source.open_source

    def spy(*args, **kwargs):
        cap = real(*args, **kwargs)
        threads.append(int(cap.get(cv2.CAP_PROP_N_THREADS)))
        return cap

    monkeypatch.setattr(stream_source, "open_source", spy)
    cores = os.cpu_count() or 1
    n = 2 * cores
    detector = Detector(Answers())
    runner = StreamRunner(detector, detector.params(), lambda *a: None, max_streams=n)
    for _ in range(n):
        runner.add(str(clip30))
    runner.run(until_done=True)
    assert threads == [1] * n
    wide = StreamRunner(detector, detector.params(), lambda *a: None, max_streams=1)
    wide.add(str(clip30))
    wide.run(until_done=True)
    assert threads[-1] == cores  # one stream alone has every core
