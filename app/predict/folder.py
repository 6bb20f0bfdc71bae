"""Offline batch inference: a folder, a file or a glob → one JSON line per image.

Four stages overlap: file reads and header checks (and, for a pipeline that does not decode
JPEG itself, OpenCV decodes) in a thread pool running a few batches ahead, bounded so memory
stays flat on any folder size; up to ``RunShape.in_flight`` batches in the detector at once
(``Detector.run``; on the GPU: decode on the decoder's stream, upload, graph;
``app.pipeline.overlap``), each batch's answers turned into its JSON lines in one go by the
thread that ran it (``app.records``); and the writes, by this thread while the next batches run.

Every per-image step of the image half holds the GIL, and the GPU pipeline's threads need it
to launch the next batch, so the image half makes no object per image beyond what it must:
names as strings (no ``Path`` per file), reads with ``os.read``, one header check per image
(its header travels with its bytes, ``EncodedImage``), no ``ImageResult`` per image
(``--save-images`` builds them), no dict or ``json.dumps`` per image (``--coco`` keeps a dict
per image and detection, from the batch's arrays: ``app.records.CocoDocument``).

Batches are the detector's own (``RunShape.max_batch``): nothing here sizes them. Under a rect
letterbox the detector takes a window of ``RECT_WINDOW_BATCHES`` batches' images at a time and
runs them grouped by input size (``Detector.run_prepared``: photos of a few common sizes fill
whole batches), answering in file order, so the output's order is the folder's either way.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from app.contracts import DetectedBatch, DetectParams, ImageResult
from app.errors import InvalidImage, YolopipeError
from app.files import SourceImage, list_images
from app.imaging.headers import IMAGE_SUFFIXES
from app.imaging.jpeg_structure import use_compiled_walk
from app.pipeline.detector import Detector
from app.pipeline.overlap import run_overlapped
from app.predict.video import VIDEO_SUFFIXES, frames_to_read, predict_video
from app.records import CocoDocument, FolderSummary, Written, image_lines, read_written

MEDIA_SUFFIXES = IMAGE_SUFFIXES | VIDEO_SUFFIXES  # what ``predict`` reads: images and videos
# Rect: images grouped by input size over windows of this many batches (one window read while the
# other runs: as many images held as three batches in flight would hold)
RECT_WINDOW_BATCHES = 2
# Reader threads. Where the pipeline decodes JPEGs itself, a reader only reads a file and checks its
# header: short turns that hold the GIL, so more readers only queue for it (each hand-over a wait)
# and starve the batch threads of their turns. On an H100 one reader kept the steady loop as fast
# as two (5,078 and 5,083 img/s, medians of three rounds) with less waiting on the GIL: 64 files
# read in 7.9 ms against 18.0, a batch's nvImageCodec call 6.5 ms against 9.0, and no round of
# its fell to two readers' worst, 4,441 (bench/predict_timeline.py,
# bench/results/2026-12-06-nvidia-h100-predict-timeline.json). Where the readers decode (OpenCV,
# which lets go of the GIL), more of them decode at once.
READERS_ENCODED = 1
READERS_DECODING = 8
# From this many images on, the readers walk JPEGs compiled, without the GIL
# (``jpeg_structure.use_compiled_walk``), where the pipeline decodes them itself. On an H100's host
# its 0.7 s load, waited for, delayed the first result by 0.5 s and then saved 85 µs an image of
# the loop: 10,000 JPEGs 7.20 s against 7.78 (bench/results/2026-12-07-nvidia-h100-jpeg-whole-ab.json).
# Loaded beside the first batches instead, on another: 6.92 s against 7.32, the first result 0.4 s
# sooner (bench/results/2026-12-07-nvidia-h100-walk-beside-ab.json).
COMPILED_WALK_FROM = 8_000


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        if fh.seek(0, 2) == 0:
            return True
        fh.seek(-1, 2)
        return fh.read(1) == b"\n"


def _read(img: SourceImage) -> bytes | YolopipeError:
    """The file's bytes: one ``os.read`` of its size (plus one byte, to see that it did not grow)
    instead of pathlib's buffered file object, whose layers cost more held GIL than the copy,
    and each system call gives the GIL away and waits to take it back."""
    try:
        fd = os.open(img.file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            size = os.fstat(fd).st_size
            parts = [os.read(fd, size + 1)]
            if len(parts[0]) != size:  # it grew, or a read came back short: read on to the end
                while parts[-1]:
                    parts.append(os.read(fd, 1 << 20))
        finally:
            os.close(fd)
    except OSError as exc:
        return InvalidImage(f"cannot read file: {exc.strerror or exc}")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _prepared(detector: Detector, img: SourceImage) -> Any:
    """Read one file and check its header (``EncodedImage``), and decode it unless the pipeline
    does, on a worker thread; an error object stands in for a bad file."""
    data = _read(img)
    if isinstance(data, YolopipeError):
        return data
    try:
        return detector.prepare(data)
    except YolopipeError as exc:
        return exc


def _prepared_chunk(detector: Detector, chunk: list[SourceImage]) -> list[Any]:
    return [_prepared(detector, img) for img in chunk]


def _batches(
    detector: Detector, images: list[SourceImage], batch: int, workers: int, ahead_batches: int
) -> Iterator[list[tuple[SourceImage, Any]]]:
    """Batches of prepared images, read (and decoded) up to ``ahead_batches`` batches ahead.

    One task reads a slice of a batch, not one file: a future per file cost more held GIL
    than the read itself (``ThreadPoolExecutor.submit`` was a quarter of the folder's GIL time).
    """
    per_task = max(1, -(-batch // workers))
    chunks = (images[i : i + batch] for i in range(0, len(images), batch))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="read") as pool:
        pending: deque[tuple[list[SourceImage], list[Future]]] = deque()

        def submit(chunk: list[SourceImage]) -> None:
            parts = [chunk[k : k + per_task] for k in range(0, len(chunk), per_task)]
            pending.append((chunk, [pool.submit(_prepared_chunk, detector, part) for part in parts]))

        for chunk in chunks:  # the first batch alone, so the pipeline starts as soon as it can
            submit(chunk)
            break
        while pending:
            chunk, futures = pending.popleft()
            ready = list(zip(chunk, (x for fut in futures for x in fut.result())))
            for nxt in chunks:
                submit(nxt)
                if len(pending) >= ahead_batches:
                    break
            yield ready


class _Progress:
    """``on_progress(advance, total)`` over the images, then the videos frame by frame. The total:
    the images plus the frames each video's container counts (``frames_to_read``; None, unknown,
    when one does not say), set right when a video ends with another count."""

    def __init__(self, on_progress: Callable[[int, int | None], None] | None, images: int,
                 video_frames: dict[str, int | None]) -> None:
        self.on_progress, self.video_frames = on_progress, video_frames
        self.total = None if None in video_frames.values() else images + sum(video_frames.values())

    def advance(self, count: int) -> None:
        if self.on_progress:
            self.on_progress(count, self.total)

    def video_ended(self, name: str, frames: int) -> None:
        expected = self.video_frames.get(name)
        if self.total is not None and expected is not None and frames != expected:
            self.total += frames - expected
            self.advance(0)


def draw_detections(path: Path, result: ImageResult, names: list[str], out_path: Path) -> None:
    """Boxes and labels drawn with OpenCV (no font download, unlike Ultralytics' plotting)."""
    img = cv2.imdecode(np.fromfile(str(path), np.uint8), cv2.IMREAD_COLOR)
    if img is None or result.detections is None:
        return
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(out_path), annotate(img, result, names))


def annotate(img: np.ndarray, result: ImageResult, names: list[str]) -> np.ndarray:
    """``img`` (BGR, drawn on in place) with the boxes and labels of ``result``."""
    if result.detections is None:
        return img
    det = result.detections
    for box, score, cid in zip(det.boxes, det.scores, det.class_ids):
        x1, y1, x2, y2 = (int(round(float(v))) for v in box)
        color = tuple(int(c) for c in np.random.default_rng(int(cid)).integers(64, 256, 3))
        cv2.rectangle(img, (x1, y1), (x2, y2), color, 2)
        label = f"{names[int(cid)] if int(cid) < len(names) else cid} {score:.2f}"
        cv2.putText(img, label, (x1, max(y1 - 4, 12)), cv2.FONT_HERSHEY_SIMPLEX, 0.5, color, 1, cv2.LINE_AA)
    return img


def predict_folder(
    detector: Detector,
    source: str,
    out: Path,
    params: DetectParams,
    *,
    resume: bool = False,
    save_images: Path | None = None,
    coco: Path | None = None,
    workers: int | None = None,
    on_progress: Callable[[int, int | None], None] | None = None,
    vid_stride: int = 1,
    track: bool = False,
) -> FolderSummary:
    """Run the detector over every image and video of ``source``, in batches of its run shape's
    ``max_batch``; JSON lines go to ``out`` as they finish (images first, then each video's
    frames, ``app.predict.video``). ``on_progress(advance, total)`` counts images and video
    frames (``_Progress``)."""
    media = list_images(source, MEDIA_SUFFIXES)
    videos = [m for m in media if _is_video(m)]
    images = [m for m in media if not _is_video(m)] if videos else media
    summary = FolderSummary()
    written = read_written(out) if resume else Written()  # --resume: the output read once
    todo = [img for img in images if img.name not in written.images] if written.images else images
    summary.skipped = len(images) - len(todo)
    video_frames = {v.name: frames_to_read(v.path, vid_stride=vid_stride, start=written.frames.get(v.name, -1) + 1)
                    for v in videos} if on_progress else {}
    progress = _Progress(on_progress, len(todo), video_frames)
    progress.advance(0)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = CocoDocument(detector.names) if coco is not None else None
    names, in_flight = detector.names, detector.shape.in_flight
    workers = workers or (READERS_ENCODED if detector.decodes_jpeg else READERS_DECODING)
    if detector.decodes_jpeg and len(todo) >= COMPILED_WALK_FROM:
        use_compiled_walk(wait=False)  # loaded beside the first batches, which walk in Python

    def detect_chunk(chunk: list[tuple[SourceImage, Any]]) -> tuple[list[SourceImage], DetectedBatch, list[str]]:
        """In a batch thread: the detector on the batch's (rect: the window's) images, then its
        JSON lines, in file order."""
        files = [img for img, _ in chunk]
        answers = detector.run_prepared([x for _, x in chunk], params)  # the readers prepared them
        return files, answers, image_lines([img.name for img in files], answers, names)

    # Square: a batch at a time, in_flight of them at once. Rect: a window at a time, whose runs (a
    # size each) the detector keeps in_flight at once itself.
    rect = detector.shape.letterbox == "rect"
    chunk = detector.shape.max_batch * (RECT_WINDOW_BATCHES if rect else 1)
    chunks = _batches(detector, todo, chunk, workers, ahead_batches=2 if rect else in_flight + 2)
    with open(out, "a" if resume else "w") as fh:
        if resume and not _ends_with_newline(out):
            fh.write("\n")  # a torn last line stays torn, on its own, instead of swallowing the next one
        for files, answers, lines in run_overlapped(detect_chunk, chunks, 1 if rect else in_flight):
            fh.write("\n".join(lines) + "\n")
            fh.flush()
            summary.images += len(files)
            summary.errors += len(answers.errors)
            summary.error_files += [f"{files[i].name}: {answers.errors[i]}" for i in sorted(answers.errors)]
            summary.detections += int(answers.counts.sum())
            if save_images is not None:
                _draw(files, answers, names, save_images)
            if document is not None:
                document.add([img.name for img in files], answers)
            progress.advance(len(files))
        if videos:
            _predict_videos(detector, videos, fh, params, summary, vid_stride=vid_stride, track=track,
                            resume_from=written.frames, save_images=save_images, coco=document, progress=progress)
    if document is not None:
        Path(coco).write_text(document.dumps() + "\n")
    return summary


def _is_video(img: SourceImage) -> bool:
    """``video.is_video(img.path)`` (``Path.suffix``'s rule), without a ``Path`` per file."""
    name = img.name.rpartition("/")[2]
    dot = name.rfind(".")
    suffix = name[dot:].lower() if 0 < dot < len(name) - 1 else ""
    return suffix in VIDEO_SUFFIXES and suffix != ".gif"


def _draw(images: list[SourceImage], answers: DetectedBatch, names: list[str], save_images: Path) -> None:
    """``--save-images``: each image drawn, from its ``ImageResult``."""
    for k, img in enumerate(images):
        if k not in answers.errors:
            draw_detections(img.path, answers.result(k), names, Path(save_images) / img.name)


def _predict_videos(
    detector: Detector, videos: list[SourceImage], fh: Any, params: DetectParams, summary: FolderSummary, *,
    vid_stride: int, track: bool, resume_from: dict[str, int], save_images: Path | None, coco: CocoDocument | None,
    progress: _Progress,
) -> None:
    """Each video's frames as JSON lines on ``fh`` (flushed per batch); ``--resume`` goes on after
    the last frame written; ``--save-images`` writes the annotated video as ``NAME.mp4``."""

    def frames_written(count: int) -> None:
        fh.flush()
        progress.advance(count)

    def write(line: str) -> None:
        fh.write(line + "\n")

    for video in videos:
        save_to = Path(save_images) / f"{video.name}.mp4" if save_images is not None else None
        result = predict_video(
            detector, video.path, video.name, write, params, vid_stride=vid_stride,
            start=resume_from.get(video.name, -1) + 1, save_to=save_to,
            annotate=(lambda img, res: annotate(img, res, detector.names)) if save_to else None,
            on_frames=frames_written, track=track, coco=coco,
        )
        fh.flush()
        progress.video_ended(video.name, result.frames)
        summary.videos += 1
        summary.images += result.frames
        summary.detections += result.detections
        if result.error is not None:
            summary.images += 1
            summary.errors += 1
            summary.error_files.append(f"{video.name}: {result.error}")
