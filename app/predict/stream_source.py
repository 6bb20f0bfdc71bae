"""One source of ``app.predict.streams``, read on a thread of its own into a bounded buffer.

* A live source (or a file read ``realtime``, at its own frame rate) keeps only its newest
  frames: when the model falls behind, the oldest buffered frame is dropped and counted.
* A file read as fast as possible never drops: its reader waits for room.
* A live source that fails (or never opens) reconnects with exponential backoff until removed.
* Opens run at once, each on its stream's thread (FFmpeg opens concurrently: ``app.predict.sources``).
  An RTSP source's server is probed first on a socket of our own (``app.predict.source_probe``),
  so that a camera that never answers holds nobody, and removing its stream stops it at once.
* A source is shown (snapshots, events, errors, logs) without the credentials of its URL.
* One source's failure stays in its own thread and its own ``state``/``error``.

Frames are decoded by OpenCV, or by NVDEC into device memory (``app.predict.sources``). An
NVDEC capture is read by the runner's decode pool (``app.predict.decode_pool``: a few threads
serve every stream) while the stream's own thread waits; an OpenCV capture by the stream's
thread, whose OpenCV/FFmpeg decoding threads are ``decode_threads`` (the runner shares the
machine's cores among its streams: many captures each starting a thread per core starve the
threads that run the model).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.contracts import DeviceNv12
from app.errors import InvalidParameter
from app.predict.source_probe import Stopped, probe
from app.source_urls import SourceUrl, parse_url, redact
from app.predict.sources import capture_fps, check_frame, is_live, open_source
from app.predict.video import check_stride

LIVE_BUFFER = 4  # frames a live stream keeps while the model is busy (newest win)
FILE_BUFFER = 64  # frames a file reader gets ahead of the model
NVDEC_FILE_BUFFER = 16  # the same, in device memory (a 1080p NV12 frame is 3 MB; many streams share the GPU)
BACKOFF_S = (0.5, 8.0)  # first and longest wait before a live source is opened again
OPEN_TIMEOUT_S = 5.0  # opening or reading a source that gives nothing for this long fails (the default)
LATENCY_WINDOW = 1024  # per stream: the frames whose latency the percentiles are taken over
FPS_WINDOW_S = 5.0


@dataclass
class StreamFrame:
    stream: Stream
    index: int  # 0-based index of the frame in the source (live: since the stream was added)
    time_s: float  # files: index / frame rate; live: seconds since the stream was added
    image: np.ndarray | DeviceNv12  # DeviceNv12: decoded by NVDEC (app.predict.sources)
    captured: float  # time.monotonic() when it was read: latency is measured from here


@dataclass
class StreamStats:
    frames_read: int = 0
    frames_done: int = 0
    dropped: int = 0
    first_read: float = 0.0  # time.monotonic() of the first frame read, and of the last
    last_read: float = 0.0
    reconnects: int = 0
    latencies_s: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    done_at: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))

    def read_fps(self) -> float:
        """Frames read per second from the first to the last (0 before two)."""
        span = self.last_read - self.first_read
        return (self.frames_read - 1) / span if self.frames_read > 1 and span > 0 else 0.0

    def fps(self, now: float) -> float:
        recent = [t for t in self.done_at if now - t <= FPS_WINDOW_S]
        if len(recent) < 2:
            return 0.0
        return (len(recent) - 1) / max(recent[-1] - recent[0], 1e-6)

    def latency_ms(self, q: float) -> float | None:
        return round(float(np.percentile(self.latencies_s, q)) * 1e3, 2) if self.latencies_s else None


class Stream:
    """One source read on its own thread into a bounded buffer (see the module docstring)."""

    def __init__(self, stream_id: str, source: str, *, max_pixels: int, vid_stride: int = 1, realtime: bool = False,
                 track: bool = False, notify: Callable[[Stream, int], None] = lambda stream, added: None,
                 decoder: str = "opencv", device: Any = None, open_timeout_s: float = OPEN_TIMEOUT_S,
                 pool: Any = None, decode_threads: int | None = None) -> None:
        """``notify(stream, added)``: after each frame buffered (``added``: how many more frames it
        holds now, 0 when one was dropped for it) and each change of state (0)."""
        self.id, self.source = stream_id, source  # what is opened
        self.shown = redact(source)  # what is shown: no credentials
        self.decoder, self.device = decoder, device  # app.predict.sources.open_source (device: Detector.cuda)
        self.pool, self.decode_threads = pool, decode_threads
        self.max_pixels = max_pixels  # the run's (RunShape.max_pixels): larger frames fail the stream
        self.open_timeout_s = open_timeout_s
        self.live = is_live(source)
        self._url = _probe_url(source) if self.live else None
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
        self._limit = LIVE_BUFFER if self.drops else NVDEC_FILE_BUFFER if decoder == "nvdec" else FILE_BUFFER
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._in_ffmpeg = False  # inside an FFmpeg open or read: a stop waits for it to return
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
    def in_ffmpeg(self) -> bool:
        """The reader is inside an FFmpeg open or read, which nothing interrupts (at most the open
        or read timeout); a stop takes effect when it returns. A probe stops at once."""
        return self._in_ffmpeg and self._thread.is_alive()

    @property
    def finished(self) -> bool:
        """Nothing more will come: the reader ended and every buffered frame was taken."""
        with self._lock:
            return not self._thread.is_alive() and not self._buffer and self._thread.ident is not None

    def drop_taken(self) -> None:
        """A frame taken for a batch came back refused or failed: counted with the drops (under
        the lock the reader counts its own drops with)."""
        with self._lock:
            self.stats.dropped += 1

    @property
    def delivered(self) -> bool:
        """Every frame read so far was handed on (processed or dropped): none is in a batch."""
        s = self.stats
        return s.frames_done + s.dropped >= s.frames_read

    def pending(self) -> int:
        with self._lock:
            return len(self._buffer)

    def take(self, n: int) -> list[StreamFrame]:
        with self._room:
            frames = [self._buffer.popleft() for _ in range(min(n, len(self._buffer)))]
            if frames and not self.drops:
                self._room.notify_all()
        return frames

    def room(self) -> int:
        """Frames the buffer takes now without dropping one (a decode pool reads this many)."""
        with self._lock:
            return self._limit - len(self._buffer)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _push(self, frame: StreamFrame) -> None:
        with self._room:
            added = 1
            if self.drops:
                if len(self._buffer) >= self._limit:
                    self._buffer.popleft()
                    self.stats.dropped += 1
                    added = 0
            else:
                while len(self._buffer) >= self._limit and not self._stop.is_set():
                    self._room.wait(0.1)
            self._buffer.append(frame)
        self._notify(self, added)

    def _read_loop(self) -> None:
        index = 0
        backoff = BACKOFF_S[0]
        try:
            while not self._stop.is_set():
                unanswered = None
                if self._url is not None:
                    unanswered = probe(self._url, self.open_timeout_s, self._stop.is_set)
                    if self._stop.is_set():
                        return
                self._in_ffmpeg = not unanswered
                cap = None if unanswered else open_source(self.source, self.decoder, device=self.device,
                                                          timeout_ms=round(self.open_timeout_s * 1e3),
                                                          max_pixels=self.max_pixels, threads=self.decode_threads)
                self._in_ffmpeg = cap is not None  # reading it, until released
                if cap is None:
                    if not self.live:
                        self.state, self.error = "failed", f"cannot open {self.shown!r}"
                        return
                    self.state, self.error = "reconnecting", f"{unanswered or f'cannot open {self.shown!r}'}; retrying"
                    self.stats.reconnects += 1
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_S[1])
                    continue
                self.state, self.error = "live", None
                self.fps = capture_fps(cap) or self.fps
                try:
                    before, index = index, self._read_frames(cap, index)
                finally:
                    cap.release()
                    self._in_ffmpeg = False
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
        except Stopped:  # removed while its server was probed
            pass
        except Exception as exc:  # noqa: BLE001 - one source's failure stays in its own stream
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}".replace(self.source, self.shown)
        finally:
            if self._stop.is_set() and self.state not in ("failed", "ended"):
                self.state = "removed"
            self._notify(self, 0)

    @property
    def period(self) -> float:
        """Seconds between frames when read at the source's own rate (a file as a camera), else 0."""
        return 1.0 / self.fps if self.realtime and self.fps else 0.0

    def _read_frames(self, cap: Any, index: int) -> int:
        """Frames of one open capture into the buffer; the next index when it stops giving any."""
        if self.pool is not None and hasattr(cap, "read"):  # NVDEC: the decode pool reads it
            return self.pool.read(self, cap, index)
        period = self.period
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
                self.keep(index, image)
            index += 1
        return index

    def keep(self, index: int, image: Any) -> None:
        """Frame ``index`` of the source (one ``vid_stride`` keeps) into the buffer, read now."""
        check_frame(image, self.shown, self.max_pixels)
        now = time.monotonic()
        time_s = index / self.fps if (self.fps and not self.live) else now - self.added
        self.stats.frames_read += 1
        self.stats.first_read = self.stats.first_read or now
        self.stats.last_read = now
        self._push(StreamFrame(self, index, round(time_s, 6), image, now))

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        s = self.stats
        seen = s.frames_done + s.dropped
        return {
            "id": self.id, "source": self.shown, "live": self.live, "state": self.state, "error": self.error,
            "source_fps": round(self.fps, 3), "fps": round(s.fps(now), 2), "frames": s.frames_done,
            "dropped": s.dropped, "dropped_pct": round(100.0 * s.dropped / seen, 3) if seen else 0.0,
            "reconnects": s.reconnects, "track": self.track,
            "latency_p50_ms": s.latency_ms(50), "latency_p99_ms": s.latency_ms(99),
        }


def _probe_url(source: str) -> SourceUrl | None:
    """The parts of a live URL to probe; None for one this check cannot read (a URL a CLI user
    typed for their own machine: FFmpeg is left to open it as it is)."""
    try:
        return parse_url(source)
    except InvalidParameter:
        return None
