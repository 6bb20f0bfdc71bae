"""Many sources at once: files, ``rtsp://``, ``http(s)://`` video, their frames in shared batches.

Each source is read by a thread of its own (OpenCV/FFmpeg) into a small buffer; one runner
thread forms batches from every stream's buffer (round robin, waiting at most ``max_wait_ms``
for a batch to fill) and hands each frame's result to ``on_frame``.

* A live source (or a file read ``realtime``, at its own frame rate) keeps only its newest
  frames: when the model falls behind, the oldest buffered frame is dropped and counted.
* A file read as fast as possible never drops: its reader waits for room.
* A live source that fails (or never opens) reconnects with exponential backoff until removed.
* One source's failure stays in its own thread and its own ``state``/``error``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.contracts import DetectParams, ImageResult
from app.errors import InvalidParameter
from app.pipeline.detector import Detector
from app.pipeline.overlap import run_overlapped
from app.pipeline.video import check_stride, frame_rate

log = logging.getLogger(__name__)

LIVE_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "udp://", "tcp://", "srt://")
LIST_SUFFIXES = (".streams", ".txt")  # Ultralytics' habit: a text file with one source per line
LIVE_BUFFER = 4  # frames a live stream keeps while the model is busy (newest win)
FILE_BUFFER = 64  # frames a file reader gets ahead of the model
BACKOFF_S = (0.5, 8.0)  # first and longest wait before a live source is opened again
OPEN_TIMEOUT_MS = 5000
LATENCY_WINDOW = 1024  # per stream: the frames whose latency the percentiles are taken over
FPS_WINDOW_S = 5.0


def is_live(source: str) -> bool:
    return source.lower().startswith(LIVE_SCHEMES)


def is_stream_source(source: str) -> bool:
    """A URL, or a ``.streams``/``.txt`` list of sources: what ``predict`` runs as streams."""
    return is_live(source) or (source.lower().endswith(LIST_SUFFIXES) and Path(source).is_file())


def read_source_list(source: str) -> list[str]:
    """The sources of a URL (itself) or of a list file (one a line; blank lines and ``#`` skipped)."""
    if is_live(source):
        return [source]
    lines = [line.strip() for line in Path(source).read_text().splitlines()]
    sources = [line for line in lines if line and not line.startswith("#")]
    if not sources:
        raise InvalidParameter(f"{source} lists no sources (one file path or URL a line)")
    return sources


def _open(source: str) -> Any:
    import cv2

    params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, OPEN_TIMEOUT_MS, cv2.CAP_PROP_READ_TIMEOUT_MSEC, OPEN_TIMEOUT_MS]
    cap = cv2.VideoCapture(source, cv2.CAP_FFMPEG, params)
    if not cap.isOpened():
        cap.release()
        return None
    return cap


@dataclass
class StreamFrame:
    stream: Stream
    index: int  # 0-based index of the frame in the source (live: since the stream was added)
    time_s: float  # files: index / frame rate; live: seconds since the stream was added
    image: np.ndarray
    captured: float  # time.monotonic() when it was read: latency is measured from here


@dataclass
class StreamStats:
    frames_read: int = 0
    frames_done: int = 0
    dropped: int = 0
    reconnects: int = 0
    latencies_s: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    done_at: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))

    def fps(self, now: float) -> float:
        recent = [t for t in self.done_at if now - t <= FPS_WINDOW_S]
        if len(recent) < 2:
            return 0.0
        return (len(recent) - 1) / max(recent[-1] - recent[0], 1e-6)

    def latency_ms(self, q: float) -> float | None:
        return round(float(np.percentile(self.latencies_s, q)) * 1e3, 2) if self.latencies_s else None


class Stream:
    """One source read on its own thread into a bounded buffer (see the module docstring)."""

    def __init__(self, stream_id: str, source: str, *, vid_stride: int = 1, realtime: bool = False,
                 track: bool = False, notify: Callable[[], None] = lambda: None) -> None:
        self.id, self.source = stream_id, source
        self.live = is_live(source)
        self.drops = self.live or realtime  # newest frames win
        self.realtime = realtime
        self.vid_stride = check_stride(vid_stride)
        self.fps = 0.0  # the source's frame rate, once opened (0: unknown)
        self.state = "connecting"  # connecting | live | reconnecting | ended | failed | removed
        self.error: str | None = None
        self.stats = StreamStats()
        self.track = track
        self.tracker: Any = None  # the runner's per-stream tracker, made on first use
        self.added = time.monotonic()
        self._buffer: deque[StreamFrame] = deque()
        self._limit = LIVE_BUFFER if self.drops else FILE_BUFFER
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._notify = notify
        self._thread = threading.Thread(target=self._read_loop, name=f"yolopipe-stream-{stream_id}", daemon=True)

    def start(self) -> Stream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._room:
            self._room.notify_all()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def reading(self) -> bool:
        return self._thread.is_alive()

    @property
    def finished(self) -> bool:
        """Nothing more will come: the reader ended and every buffered frame was taken."""
        with self._lock:
            return not self._thread.is_alive() and not self._buffer and self._thread.ident is not None

    def pending(self) -> int:
        with self._lock:
            return len(self._buffer)

    def take(self, n: int) -> list[StreamFrame]:
        with self._room:
            frames = [self._buffer.popleft() for _ in range(min(n, len(self._buffer)))]
            self._room.notify_all()
        return frames

    def _push(self, frame: StreamFrame) -> None:
        with self._room:
            if self.drops:
                if len(self._buffer) >= self._limit:
                    self._buffer.popleft()
                    self.stats.dropped += 1
            else:
                while len(self._buffer) >= self._limit and not self._stop.is_set():
                    self._room.wait(0.1)
            self._buffer.append(frame)
        self._notify()

    def _read_loop(self) -> None:
        index = 0
        backoff = BACKOFF_S[0]
        try:
            while not self._stop.is_set():
                cap = _open(self.source)
                if cap is None:
                    if not self.live:
                        self.state, self.error = "failed", f"cannot open {self.source!r}"
                        return
                    self.state, self.error = "reconnecting", f"cannot open {self.source!r}; retrying"
                    self.stats.reconnects += 1
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_S[1])
                    continue
                self.state, self.error = "live", None
                self.fps = frame_rate(cap) or self.fps
                try:
                    before, index = index, self._read_frames(cap, index)
                finally:
                    cap.release()
                if self._stop.is_set():
                    self.state = "removed"
                    return
                if not self.live:
                    self.state = "ended"
                    return
                self.state, self.error = "reconnecting", "the source stopped sending frames; retrying"
                self.stats.reconnects += 1
                backoff = BACKOFF_S[0] if index > before else backoff  # it had worked: start over
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
        except Exception as exc:  # noqa: BLE001 - one source's failure stays in its own stream
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            if self._stop.is_set() and self.state not in ("failed", "ended"):
                self.state = "removed"
            self._notify()

    def _read_frames(self, cap: Any, index: int) -> int:
        """Frames of one open capture into the buffer; the next index when it stops giving any."""
        period = 1.0 / self.fps if self.realtime and self.fps else 0.0
        started = time.monotonic()
        first = index
        while not self._stop.is_set():
            if period:  # a file as a camera: frames come at the source's own rate
                due = started + (index - first) * period
                if (wait := due - time.monotonic()) > 0:
                    self._stop.wait(wait)
            if not cap.grab():
                return index
            if index % self.vid_stride == 0:
                ok, image = cap.retrieve()
                if not ok or image is None:
                    return index
                now = time.monotonic()
                time_s = index / self.fps if (self.fps and not self.live) else now - self.added
                self.stats.frames_read += 1
                self._push(StreamFrame(self, index, round(time_s, 6), image, now))
            index += 1
        return index

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        s = self.stats
        seen = s.frames_done + s.dropped
        return {
            "id": self.id, "source": self.source, "live": self.live, "state": self.state, "error": self.error,
            "source_fps": round(self.fps, 3), "fps": round(s.fps(now), 2), "frames": s.frames_done,
            "dropped": s.dropped, "dropped_pct": round(100.0 * s.dropped / seen, 3) if seen else 0.0,
            "reconnects": s.reconnects, "track": self.track,
            "latency_p50_ms": s.latency_ms(50), "latency_p99_ms": s.latency_ms(99),
        }


OnFrame = Callable[[StreamFrame, ImageResult, "list[int | None] | None"], None]
DetectFrames = Callable[[list[np.ndarray]], list[ImageResult]]


class StreamRunner:
    """Batches the frames of every stream through one detector; streams come and go at any time."""

    def __init__(self, detector: Detector, params: DetectParams, on_frame: OnFrame, *, max_batch: int | None = None,
                 max_wait_ms: float = 5.0, track: bool = False, max_streams: int = 256,
                 detect: DetectFrames | None = None) -> None:
        """``detect``: how a batch of frames is detected (default: ``detector.detect`` with ``params``;
        the server hands them to its batcher instead, so they share batches with HTTP images)."""
        self.detector, self.params, self.on_frame = detector, params, on_frame
        self._detect_frames = detect or (lambda images: detector.detect(images, params))
        self.max_batch = min(max_batch or detector.pipeline.max_batch, detector.pipeline.max_batch)
        self.max_wait_s = max_wait_ms / 1e3
        self.track = track
        self.max_streams = max_streams
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._cursor = 0

    # --- control (any thread) ---------------------------------------------------------
    def add(self, source: str, *, stream_id: str | None = None, vid_stride: int = 1, realtime: bool = False,
            track: bool = False) -> Stream:
        with self._lock:
            if len(self._streams) >= self.max_streams:
                raise InvalidParameter(f"at most {self.max_streams} streams at once")
            stream_id = stream_id or str(next(self._ids))
            if stream_id in self._streams:
                raise InvalidParameter(f"stream {stream_id!r} exists")
            stream = Stream(stream_id, source, vid_stride=vid_stride, realtime=realtime, track=track or self.track,
                            notify=self._notify)
            self._streams[stream_id] = stream
        return stream.start()

    def remove(self, stream_id: str) -> bool:
        with self._lock:
            stream = self._streams.pop(stream_id, None)
        if stream is None:
            return False
        stream.stop()
        stream.state = "removed"
        return True

    def streams(self) -> list[Stream]:
        with self._lock:
            return list(self._streams.values())

    def get(self, stream_id: str) -> Stream | None:
        with self._lock:
            return self._streams.get(stream_id)

    def stop(self) -> None:
        self._stop.set()
        self._notify()
        for stream in self.streams():
            stream.stop()

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    # --- the runner thread -------------------------------------------------------------
    def run(self, *, until_done: bool = True) -> None:
        """Process frames until ``stop``, or (``until_done``) until every stream has finished."""
        depth = self.detector.pipeline.max_in_flight
        for frames, results in run_overlapped(self._detect, self._batches(until_done), depth):
            for frame, result in zip(frames, results):
                self._deliver(frame, result)
        for stream in self.streams():
            stream.stop()

    def _batches(self, until_done: bool) -> Iterator[list[StreamFrame]]:
        while not self._stop.is_set():
            batch = self._gather()
            if batch:
                yield batch
            elif until_done and all(s.finished for s in self.streams()):
                return

    def _gather(self) -> list[StreamFrame]:
        """Up to ``max_batch`` frames, round robin over the streams; once one frame is there, wait
        at most ``max_wait_s`` for more."""
        with self._wake:
            if not self._available():
                self._wake.wait(0.1)
                if not self._available():
                    return []
            deadline = time.monotonic() + self.max_wait_s
            while self._available() < self.max_batch and (left := deadline - time.monotonic()) > 0:
                if self._stop.is_set() or all(not s.reading for s in self._streams.values()):
                    break
                self._wake.wait(left)
            streams = list(self._streams.values())
        batch: list[StreamFrame] = []
        if not streams:
            return batch
        self._cursor = (self._cursor + 1) % len(streams)
        order = streams[self._cursor:] + streams[: self._cursor]
        while len(batch) < self.max_batch:
            taken = len(batch)
            for stream in order:
                if len(batch) < self.max_batch:
                    batch.extend(stream.take(1))
            if len(batch) == taken:
                break
        return batch

    def _available(self) -> int:
        return sum(s.pending() for s in self._streams.values())

    def _detect(self, frames: list[StreamFrame]) -> tuple[list[StreamFrame], list[ImageResult]]:
        return frames, self._detect_frames([f.image for f in frames])

    def _deliver(self, frame: StreamFrame, result: ImageResult) -> None:
        stream = frame.stream
        if stream.state == "removed":
            return
        ids = None
        if stream.track and result.detections is not None:
            if stream.tracker is None:
                from app.pipeline.tracking import StreamTracker

                stream.tracker = StreamTracker((stream.fps or 30.0) / stream.vid_stride)
            ids = stream.tracker.update(result.detections)
        now = time.monotonic()
        if result.error is not None:  # refused (a server over its time budget) or failed: not processed
            stream.stats.dropped += 1
        else:
            stream.stats.frames_done += 1
            stream.stats.latencies_s.append(now - frame.captured)
            stream.stats.done_at.append(now)
        try:
            self.on_frame(frame, result, ids)
        except Exception:  # a consumer's failure must not stop the other streams
            log.exception("stream %s: delivering frame %d failed", stream.id, frame.index)


def frame_event(frame: StreamFrame, result: ImageResult, ids: list[int | None] | None, names: list[str]) -> dict[str, Any]:
    """One processed frame as a JSON object: its stream, where it sits, and its detections."""
    from app.pipeline.tracking import with_track_ids

    rec = result.to_json("", names)
    rec.pop("image", None)
    if ids is not None and "detections" in rec:
        rec["detections"] = with_track_ids(rec["detections"], ids)
    latency_ms = round((time.monotonic() - frame.captured) * 1e3, 2)
    return {"stream": frame.stream.id, "source": frame.stream.source, "frame": frame.index, "time_s": frame.time_s,
            **rec, "latency_ms": latency_ms}


@dataclass
class StreamsSummary:
    streams: int = 0
    frames: int = 0
    detections: int = 0
    dropped: int = 0
    failed: list[str] = field(default_factory=list)  # "source: why" of each stream that never ran to its end


def predict_streams(detector: Detector, sources: list[str], write: Callable[[dict[str, Any]], None],
                    params: DetectParams, *, vid_stride: int = 1, track: bool = False, realtime: bool = False,
                    max_wait_ms: float = 5.0) -> StreamsSummary:
    """Run every source at once (ids ``0``, ``1``, … in list order) until all have ended (or Ctrl-C);
    ``write`` gets each frame's JSON object as soon as its batch is done."""
    summary = StreamsSummary(streams=len(sources))
    lock = threading.Lock()

    def on_frame(frame: StreamFrame, result: ImageResult, ids: list[int | None] | None) -> None:
        with lock:
            write(frame_event(frame, result, ids, detector.names))
            summary.frames += 1
            summary.detections += len(result.detections or [])

    runner = StreamRunner(detector, params, on_frame, max_wait_ms=max_wait_ms, track=track,
                          max_streams=max(len(sources), 1))
    for source in sources:
        runner.add(source, vid_stride=vid_stride, realtime=realtime)
    try:
        runner.run(until_done=True)
    finally:
        runner.stop()
    for stream in runner.streams():
        summary.dropped += stream.stats.dropped
        if stream.state == "failed":
            summary.failed.append(f"{stream.source}: {stream.error}")
            write({"stream": stream.id, "source": stream.source, "error": stream.error})
    return summary
