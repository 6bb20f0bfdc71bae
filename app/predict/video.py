"""Video files in ``predict``: frames decoded by OpenCV (FFmpeg), one JSON line per frame.

A frame's line is an image's line plus where it sits in the video: ``"frame"`` (0-based,
presentation order, counted before ``vid_stride`` skips any) and ``"time_s"`` (the frame's
index over the container's frame rate). Decoding runs on its own thread a few batches ahead,
so it overlaps with the detector; by NVDEC into device memory when the detector's GPU
pipeline has it (``app.predict.sources.video_decoder``), by OpenCV otherwise and whenever the
annotated video is written (that needs the pixels on the host).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from app.contracts import DetectedBatch, DetectParams, DeviceNv12, ImageResult
from app.errors import InvalidImage, InvalidParameter
from app.pipeline.detector import Detector
from app.pipeline.overlap import run_overlapped
from app.predict.sources import capture_fps, check_frame, open_opencv, open_source, video_decoder
from app.records import LINES, CocoDocument, error_line, frame_lines

# Ultralytics' VID_FORMATS: what it reads as video.
VIDEO_SUFFIXES = frozenset(
    {".asf", ".avi", ".gif", ".m4v", ".mkv", ".mov", ".mp4", ".mpeg", ".mpg", ".ts", ".wmv", ".webm"}
)


def is_video(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES and path.suffix.lower() != ".gif"  # a .gif reads as an image


@dataclass
class VideoFrame:
    index: int  # 0-based presentation index in the source
    time_s: float
    image: np.ndarray | DeviceNv12  # BGR uint8 HWC, or NV12 in device memory (NVDEC)


def check_stride(vid_stride: int) -> int:
    if vid_stride < 1:
        raise InvalidParameter(f"vid-stride must be >= 1, got {vid_stride}")
    return vid_stride


def open_capture(source: str, *, max_pixels: int) -> cv2.VideoCapture:
    """An OpenCV capture through its FFmpeg backend; ``InvalidImage`` when nothing opens it or
    its frames are over ``max_pixels``."""
    cap = open_source(source, "opencv", max_pixels=max_pixels)
    if cap is None:
        raise InvalidImage(f"cannot open video {source!r}")
    return cap


def read_frames(path: Path, *, max_pixels: int, vid_stride: int = 1, start: int = 0, decoder: str = "opencv",
                device: Any = None) -> Iterator[VideoFrame]:
    """Every ``vid_stride``-th frame of a video file, from frame ``start`` on (skipped frames are
    grabbed, never converted), decoded by ``decoder`` (``app.predict.sources``; NVDEC on
    ``device``, the detector's ``Detector.cuda``). Ends at the end
    of the file or at the first unreadable frame; a frame over ``max_pixels`` is an ``InvalidImage``."""
    cap = open_source(str(path), decoder, device=device, max_pixels=max_pixels)
    if cap is None:
        raise InvalidImage(f"cannot open video {str(path)!r}")
    try:
        fps = capture_fps(cap)
        index = 0
        while cap.grab():
            if index >= start and index % vid_stride == 0:
                ok, image = cap.retrieve()
                if not ok or image is None:
                    return
                check_frame(image, str(path), max_pixels)
                yield VideoFrame(index, round(index / fps, 6) if fps else 0.0, image)
            index += 1
    finally:
        cap.release()


def frames_to_read(path: Path, *, vid_stride: int = 1, start: int = 0) -> int | None:
    """How many frames ``read_frames`` will give, from the frame count the container reports, for
    a progress bar: an estimate for some containers; None when it reports none; 0 when nothing
    opens the file (the video is then one error line)."""
    cap = open_opencv(str(path))
    if cap is None:
        return 0
    try:
        count = cap.get(cv2.CAP_PROP_FRAME_COUNT)
    finally:
        cap.release()
    if not count > 0:  # 0, -1 or NaN: unknown
        return None
    first = -(-start // vid_stride) * vid_stride  # the first index read: at or after start, on the stride
    return len(range(first, int(count), vid_stride))


def prefetch(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """``items`` produced on a thread of its own, at most ``depth`` ahead of the consumer; an
    exception in the producer is raised in the consumer."""
    q: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(end)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put(exc)

    thread = threading.Thread(target=produce, name="yolopipe-video-read", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def _chunks(frames: Iterator[VideoFrame], size: int) -> Iterator[list[VideoFrame]]:
    chunk: list[VideoFrame] = []
    for frame in frames:
        chunk.append(frame)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass
class VideoSummary:
    frames: int = 0
    detections: int = 0
    error: str | None = None  # the video could not be opened at all


class AnnotatedVideo:
    """The frames of one video with their boxes drawn, written as MP4 (``--save-images``)."""

    def __init__(self, path: Path, fps: float) -> None:
        self.path, self.fps = path, fps or 30.0
        self._writer: cv2.VideoWriter | None = None

    def write(self, image: np.ndarray) -> None:
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            h, w = image.shape[:2]
            self._writer = cv2.VideoWriter(str(self.path), cv2.VideoWriter_fourcc(*"mp4v"), self.fps, (w, h))
        self._writer.write(image)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.release()


def predict_video(
    detector: Detector,
    path: Path,
    name: str,
    write: Callable[[str], None],
    params: DetectParams,
    *,
    vid_stride: int = 1,
    start: int = 0,
    annotate: Callable[[np.ndarray, ImageResult], np.ndarray] | None = None,
    save_to: Path | None = None,
    on_frames: Callable[[int], None] | None = None,
    track: bool = False,
    coco: CocoDocument | None = None,
) -> VideoSummary:
    """Detect on the frames of one video, in batches of the detector's ``RunShape.max_batch``;
    ``write`` gets each frame's JSON line (no newline, from ``app.records.frame_lines``), in
    frame order.

    ``annotate`` and ``save_to`` together write the annotated video there; ``track`` adds
    ByteTrack ids (``app.predict.tracking``; a resumed video's tracks start afresh); ``coco``
    gets each frame that was detected, as ``NAME#FRAME``."""
    summary = VideoSummary()
    max_pixels = detector.shape.max_pixels
    try:
        cap = open_capture(str(path), max_pixels=max_pixels)
    except InvalidImage as exc:
        summary.error = str(exc)
        write(error_line(LINES.fields(image=name), summary.error))
        return summary
    fps = capture_fps(cap)
    size = (int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT) or 0), int(cap.get(cv2.CAP_PROP_FRAME_WIDTH) or 0))
    cap.release()
    tracker = None
    if track:
        from app.predict.tracking import StreamTracker

        tracker = StreamTracker((fps or 30.0) / vid_stride)
    writer = AnnotatedVideo(save_to, fps / vid_stride if fps else 0.0) if annotate and save_to else None
    decoder = "opencv" if writer is not None else video_decoder(detector)
    batch = detector.shape.max_batch
    if decoder == "nvdec":  # room and graphs for its batches now: no capture while the reader uses the GPU
        detector.warmup(range(1, batch + 1), nv12=True, frame_size=size if all(size) else None)
    frames = prefetch(_chunks(read_frames(path, max_pixels=max_pixels, vid_stride=vid_stride, start=start,
                                          decoder=decoder, device=detector.cuda), batch), depth=3)

    def detect(chunk: list[VideoFrame]) -> tuple[list[VideoFrame], DetectedBatch]:
        return chunk, detector.run([f.image for f in chunk], params)

    try:
        for chunk, answers in _frames_detected(detect, frames, detector.shape.in_flight, summary):
            track_ids = None
            if tracker is not None:
                track_ids = [None if k in answers.errors else tracker.update(answers.detections(k))
                             for k in range(len(chunk))]
            for line in frame_lines(name, [(f.index, f.time_s) for f in chunk], answers, detector.names, track_ids):
                write(line)
            if coco is not None:
                coco.add([f"{name}#{f.index}" for f in chunk], answers)
            summary.frames += len(chunk)
            summary.detections += int(answers.counts.sum())
            if writer is not None and annotate is not None:
                for k, frame in enumerate(chunk):
                    writer.write(annotate(frame.image, answers.result(k)))
            if on_frames:
                on_frames(len(chunk))
    finally:
        if writer is not None:
            writer.close()
    if summary.error is not None:  # a frame over the pixel limit after the first ones
        write(error_line(LINES.fields(image=name), summary.error))
    return summary


def _frames_detected(detect: Callable, frames: Iterator, in_flight: int, summary: VideoSummary) -> Iterator:
    """``run_overlapped`` over the video's chunks; a frame the reader refuses ends the video as
    ``summary.error`` (the chunks before its own are written)."""
    try:
        yield from run_overlapped(detect, frames, in_flight)
    except InvalidImage as exc:
        summary.error = str(exc)
