"""Many sources at once: files, ``rtsp://``, ``http(s)://`` video, their frames in shared batches.

Each source is read by a thread of its own into a small buffer (``app.predict.stream_source``:
drops, reconnects, failures); one runner thread forms batches from every stream's buffer (round
robin, up to the detector's ``RunShape.max_batch``, waiting at most its ``max_wait_ms`` for a
batch to fill) and hands each batch's answers to ``on_frames`` (``event_lines`` writes their
events). The runner keeps a count of the frames buffered, so that forming a batch costs the
same with 4 streams as with 400, and is woken by the first frame and by a full batch, not by
every frame. Frames are decoded as ``app.predict.sources.video_decoder`` says: by NVDEC into
device memory when the detector's GPU pipeline has it (the runner's ``DecodePool`` reads every
stream's NVDEC capture, ``app.predict.decode_pool``), else by OpenCV, each capture with its
share of the machine's cores as decoding threads; a server's streams (``detect`` given: their
frames join its batcher's batches of host images) by OpenCV.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from app.config import MAX_STREAMS, nvdec_threads
from app.contracts import DetectedBatch, DetectParams, PipelineInput
from app.errors import InvalidParameter, Overloaded
from app.pipeline.detector import Detector
from app.pipeline.overlap import run_overlapped
from app.predict.sources import is_live, let_ffmpeg_open_in_parallel, video_decoder
from app.predict.stream_source import LIVE_BUFFER, OPEN_TIMEOUT_S, Stream, StreamFrame
from app.records import LINES, records

__all__ = ["LIVE_BUFFER", "Stream", "StreamFrame", "StreamRunner", "event_lines", "is_live", "is_stream_source",
           "predict_streams", "read_source_list"]

log = logging.getLogger(__name__)

LIST_SUFFIXES = (".streams", ".txt")  # Ultralytics' habit: a text file with one source per line


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


# A batch's frames (of streams not removed), their answers, and per frame its track ids (None: untracked).
TrackIds = list["list[int | None] | None"]
OnFrames = Callable[[list[StreamFrame], DetectedBatch, TrackIds], None]
DetectFrames = Callable[[list[PipelineInput]], DetectedBatch]


class StreamRunner:
    """Batches the frames of every stream through one detector; streams come and go at any time."""

    def __init__(self, detector: Detector, params: DetectParams, on_frames: OnFrames, *,
                 max_wait_ms: float | None = None, track: bool = False, max_streams: int = MAX_STREAMS,
                 detect: DetectFrames | None = None, open_timeout_s: float = OPEN_TIMEOUT_S) -> None:
        """``detect``: how a batch of frames is detected (default: ``detector.run`` with ``params``;
        the server hands them to its batcher instead, so they share batches with HTTP images).
        Batches are up to ``detector.shape.max_batch`` frames, waiting at most ``max_wait_ms``
        (default: ``detector.shape.max_wait_ms``) for one to fill. ``open_timeout_s``: how long
        opening or reading a source may give nothing before it fails."""
        let_ffmpeg_open_in_parallel()  # before any reader thread opens a source
        self.detector, self.params, self.on_frames = detector, params, on_frames
        self._detect_frames = detect or (lambda images: detector.run(images, params))
        self.decoder = "opencv" if detect is not None else video_decoder(detector)
        self.pool = None
        if self.decoder == "nvdec":  # capture the NV12 graphs now: no capture while readers use the GPU
            detector.warmup(nv12=True)
            self.pool = self._decode_pool()
        self.max_batch = detector.shape.max_batch
        self.max_wait_s = (detector.shape.max_wait_ms if max_wait_ms is None else max_wait_ms) / 1e3
        self.track = track
        self.max_streams = max_streams
        self.open_timeout_s = open_timeout_s
        # OpenCV captures share the cores: FFmpeg's default of a thread per core for each of
        # 32 captures is 512 threads on 16 cores, and the model's threads get what is left.
        self.decode_threads = max(1, (os.cpu_count() or 1) // max(1, max_streams))
        self._streams: dict[str, Stream] = {}
        self._closing: list[Stream] = []  # removed, their reader still in an FFmpeg open or read
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._cursor = 0
        self._pending = 0  # frames buffered over every stream (kept by the streams' notify)

    def _decode_pool(self):
        from app.gpu.nvdec import decoder_engines
        from app.predict.decode_pool import DecodePool

        device = self.detector.device or 0

        def on_device():  # the decode threads' current device: the pipeline's
            import contextlib

            if device == 0:
                return contextlib.nullcontext()
            import torch

            return torch.cuda.device(device)

        def prepare(cap) -> None:  # room for a batch of its frames before they come (no capture then)
            if cap.height and cap.width:
                self.detector.warmup(nv12=True, frame_size=(cap.height, cap.width))

        cuda = self.detector.cuda  # a decode call that waits out a capture is not stalled
        return DecodePool(nvdec_threads(decoder_engines(device)), on_device=on_device, prepare=prepare,
                          open_since=cuda.open_since if cuda is not None else None)

    # --- control (any thread) ---------------------------------------------------------
    def add(self, source: str, *, stream_id: str | None = None, vid_stride: int = 1, realtime: bool = False,
            track: bool = False) -> Stream:
        """A new stream, its reader started. Every stream counts against ``max_streams`` until its
        reader has let go of its source: a removed one whose reader is inside an FFmpeg open or
        read (which nothing interrupts; at most the open/read timeout) still counts, and a stream
        refused for it is ``Overloaded`` (a removed one that was probing its server stops at once)."""
        with self._lock:
            self._closing = [s for s in self._closing if s.reading]
            holding = sum(s.in_ffmpeg for s in self._closing)
            if len(self._streams) >= self.max_streams:
                raise InvalidParameter(f"at most {self.max_streams} streams at once")
            if len(self._streams) + holding >= self.max_streams:
                raise Overloaded(f"at most {self.max_streams} streams at once, and {holding} removed ones are "
                                 f"still closing their source (within {self.open_timeout_s:g} s); retry shortly")
            stream_id = stream_id or str(next(self._ids))
            if stream_id in self._streams:
                raise InvalidParameter(f"stream {stream_id!r} exists")
            stream = Stream(stream_id, source, vid_stride=vid_stride, realtime=realtime, track=track or self.track,
                            decoder=self.decoder, device=self.detector.cuda,
                            max_pixels=self.detector.shape.max_pixels, notify=self._on_stream,
                            open_timeout_s=self.open_timeout_s, pool=self.pool, decode_threads=self.decode_threads)
            self._streams[stream_id] = stream
        return stream.start()

    def remove(self, stream_id: str) -> bool:
        """Stop a stream at once: its frames stop, its reader stops (a probe at once; an FFmpeg
        open or read when it returns)."""
        with self._lock:
            stream = self._streams.pop(stream_id, None)
            if stream is not None:
                self._pending -= stream.pending()
                self._closing.append(stream)
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
        if self.pool is not None:
            self.pool.close()

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _on_stream(self, stream: Stream, added: int) -> None:
        """A stream buffered a frame (``added``: 1, or 0 when it dropped one for it) or changed
        state (0): wake the runner for the first frame, a full batch, or the change. A removed
        stream's frames are not counted: nobody takes them."""
        with self._wake:
            if self._streams.get(stream.id) is not stream:
                return
            self._pending += added
            if added == 0 or self._pending in (1, self.max_batch):
                self._wake.notify_all()

    # --- the runner thread -------------------------------------------------------------
    def run(self, *, until_done: bool = True) -> None:
        """Process frames until ``stop``, or (``until_done``) until every stream has finished."""
        batches = run_overlapped(self._detect, self._batches(until_done), self.detector.shape.in_flight)
        try:
            for frames, answers in batches:
                self._deliver(frames, answers)
        finally:
            for stream in self.streams():
                stream.stop()
            if self.pool is not None:
                self.pool.close()

    def _batches(self, until_done: bool) -> Iterator[list[StreamFrame]]:
        while not self._stop.is_set():
            batch = self._gather()
            if batch:
                yield batch
            elif until_done and all(s.finished for s in self.streams()):
                return
            elif not until_done:
                # Idle: an empty batch hands back the batches still in flight now (run_overlapped
                # yields a result only once it has the next item), not when another frame comes.
                yield batch

    def _gather(self) -> list[StreamFrame]:
        """Up to ``max_batch`` frames, round robin over the streams; once one frame is there, wait
        at most ``max_wait_s`` for more."""
        with self._wake:
            if self._pending <= 0:
                self._wake.wait(0.1)
                if self._pending <= 0 and not self._stragglers():
                    return []
            deadline = time.monotonic() + self.max_wait_s
            while self._pending < self.max_batch and (left := deadline - time.monotonic()) > 0:
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
        with self._wake:
            self._pending -= len(batch)
        return batch

    def _stragglers(self) -> bool:
        """Frames the count has not seen yet (a stream buffers, then tells): looked for only
        when the count says none, after a wait."""
        count = sum(s.pending() for s in self._streams.values())
        self._pending = max(self._pending, count)
        return count > 0

    def _detect(self, frames: list[StreamFrame]) -> tuple[list[StreamFrame], DetectedBatch | None]:
        """One batch (the detector runs device frames and host frames apart); none for an idle
        turn's empty batch."""
        if not frames:
            return frames, None
        return frames, self._detect_frames([f.image for f in frames])

    def _deliver(self, frames: list[StreamFrame], answers: DetectedBatch | None) -> None:
        if answers is None:  # an idle turn: nothing was run
            return
        kept = [k for k, f in enumerate(frames) if f.stream.state != "removed"]
        if len(kept) < len(frames):
            frames, answers = [frames[k] for k in kept], answers.take(kept)
        if not frames:
            return
        track_ids: TrackIds = []
        now = time.monotonic()
        for k, frame in enumerate(frames):
            stream = frame.stream
            ids = None
            failed = k in answers.errors
            if stream.track and not failed:
                if stream.tracker is None:
                    from app.predict.tracking import StreamTracker

                    stream.tracker = StreamTracker((stream.fps or 30.0) / stream.vid_stride)
                ids = stream.tracker.update(answers.detections(k))
            track_ids.append(ids)
            if failed:  # refused (a server over its time budget) or failed: not processed
                stream.drop_taken()
            else:
                stream.stats.frames_done += 1
                stream.stats.latencies_s.append(now - frame.captured)
                stream.stats.done_at.append(now)
        try:
            self.on_frames(frames, answers, track_ids)
        except Exception:  # a consumer's failure must not stop the other streams
            log.exception("delivering a batch of %d stream frames failed", len(frames))


def event_lines(frames: list[StreamFrame], answers: DetectedBatch, track_ids: TrackIds | None,
                names: list[str]) -> list[str]:
    """Each processed frame's event as a JSON object (``app.records``): its stream, where it sits,
    its detections, and how long after it was read this is (``latency_ms``)."""
    now = time.monotonic()
    heads = [LINES.fields(stream=f.stream.id, source=f.stream.shown, frame=f.index, time_s=f.time_s) for f in frames]
    tails = [LINES.fields(latency_ms=round((now - f.captured) * 1e3, 2)) for f in frames]
    return records(heads, answers, names, tails=tails, track_ids=track_ids)


@dataclass
class StreamsSummary:
    streams: int = 0
    frames: int = 0
    detections: int = 0
    dropped: int = 0
    failed: list[str] = field(default_factory=list)  # "source: why" of each stream that never ran to its end


def predict_streams(detector: Detector, sources: list[str], write: Callable[[str], None],
                    params: DetectParams, *, vid_stride: int = 1, track: bool = False,
                    realtime: bool = False) -> StreamsSummary:
    """Run every source at once (ids ``0``, ``1``, … in list order) until all have ended (or Ctrl-C);
    ``write`` gets each frame's JSON line (no newline) as soon as its batch is done."""
    summary = StreamsSummary(streams=len(sources))
    lock = threading.Lock()

    def on_frames(frames: list[StreamFrame], answers: DetectedBatch, track_ids: TrackIds) -> None:
        lines = event_lines(frames, answers, track_ids, detector.names)
        with lock:
            for line in lines:
                write(line)
            summary.frames += len(frames)
            summary.detections += int(answers.counts.sum())

    runner = StreamRunner(detector, params, on_frames, track=track, max_streams=max(len(sources), 1))
    for source in sources:
        runner.add(source, vid_stride=vid_stride, realtime=realtime)
    try:
        runner.run(until_done=True)
    finally:
        runner.stop()
    for stream in runner.streams():
        summary.dropped += stream.stats.dropped
        if stream.state == "failed":
            summary.failed.append(f"{stream.shown}: {stream.error}")
            write(LINES.dumps({"stream": stream.id, "source": stream.shown, "error": stream.error}))
    return summary
