"""Offline batch inference: a folder, a file or a glob → one JSON line per image.

Four stages overlap: file reads (and, for a pipeline that does not decode JPEG itself, OpenCV
decodes) in a thread pool running a few batches ahead, bounded so memory stays flat on any
folder size; up to ``pipeline.max_in_flight`` batches in the detector at once (on the GPU:
decode on the decoder's stream, upload, graph; ``app.pipeline.overlap``); and the JSON lines,
written by this thread while the next batches run.
"""

from __future__ import annotations

import glob
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from app.config import PREDICT_BATCH
from app.contracts import DetectParams, ImageResult
from app.errors import InvalidParameter, YolopipeError
from app.imaging.headers import IMAGE_SUFFIXES
from app.pipeline.detector import Detector
from app.pipeline.overlap import run_overlapped
from app.pipeline.video import VIDEO_SUFFIXES, frames_done, is_video, predict_video


@dataclass(frozen=True)
class SourceImage:
    path: Path
    name: str  # path relative to SOURCE, as written in the output


MEDIA_SUFFIXES = IMAGE_SUFFIXES | VIDEO_SUFFIXES  # what ``predict`` reads: images and videos


def list_images(source: str, suffixes: frozenset[str] = IMAGE_SUFFIXES) -> list[SourceImage]:
    """Files with these suffixes (images by default) of a folder (recursive), a single file, or a
    glob pattern, sorted."""
    src = Path(source).expanduser()
    if src.is_dir():
        return _walk(src, suffixes)
    if src.is_file():
        return [SourceImage(src, src.name)]
    matches = sorted(Path(p) for p in glob.glob(str(src), recursive=True))
    files = [p for p in matches if p.is_file() and p.suffix.lower() in suffixes]
    if not files:
        raise InvalidParameter(f"no images found at {source!r} (a folder, an image file, or a glob pattern)")
    root = _glob_root(src)
    return [SourceImage(p, _relative(p, root)) for p in files]


def _walk(root: Path, suffixes: frozenset[str]) -> list[SourceImage]:
    """A folder's files with these suffixes, recursively, in the order of their relative names: ``os.walk`` and
    string slicing, since pathlib's ``rglob`` + ``relative_to`` cost ~50 µs a file (half a
    second of held GIL on a folder of 10,000)."""
    base = str(root)
    cut = len(base) + 1 if not base.endswith(os.sep) else len(base)
    found: list[tuple[str, str]] = []
    for folder, _, names in os.walk(base):
        for name in names:
            if os.path.splitext(name)[1].lower() in suffixes:
                full = os.path.join(folder, name)
                if os.path.isfile(full):
                    found.append((full[cut:].replace(os.sep, "/"), full))
    found.sort(key=lambda f: f[0].split("/"))  # rglob's sorted order: by path components
    return [SourceImage(Path(full), rel) for rel, full in found]


def _glob_root(pattern: Path) -> Path:
    """The leading folders of a glob pattern that hold no wildcard: names are relative to it."""
    root = Path(pattern.anchor)
    for part in pattern.parts[len(pattern.parts[:1]) if pattern.anchor else 0 :]:
        if glob.has_magic(part):
            break
        root = root / part
    return root


def _relative(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def already_done(out: Path) -> set[str]:
    """Images already written to ``out`` (for ``--resume``); a torn last line is ignored. Video
    frames (lines with ``"frame"``) are not images: ``app.pipeline.video.frames_done`` has them."""
    done: set[str] = set()
    if not out.is_file():
        return done
    for line in out.read_text().splitlines():
        try:
            rec = json.loads(line)
            if "frame" not in rec:
                done.add(rec["image"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        if fh.seek(0, 2) == 0:
            return True
        fh.seek(-1, 2)
        return fh.read(1) == b"\n"


def _read(img: SourceImage) -> bytes | YolopipeError:
    try:
        return img.path.read_bytes()
    except OSError as exc:
        from app.errors import InvalidImage

        return InvalidImage(f"cannot read file: {exc.strerror or exc}")


def _prepared(detector: Detector, img: SourceImage) -> Any:
    """Read and decode one file on a worker thread; an error object stands in for a bad file."""
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

        for chunk in chunks:
            submit(chunk)
            if len(pending) >= ahead_batches:
                break
        while pending:
            chunk, futures = pending.popleft()
            for nxt in chunks:
                submit(nxt)
                break
            yield list(zip(chunk, (x for fut in futures for x in fut.result())))


@dataclass
class FolderSummary:
    images: int = 0  # JSON lines written: images and video frames
    videos: int = 0
    errors: int = 0
    detections: int = 0
    skipped: int = 0
    error_files: list[str] = field(default_factory=list)


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


def coco_document(records: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """COCO-style detections: images, categories, and detections as scored annotations."""
    images, annotations = [], []
    for image_id, rec in enumerate(r for r in records if "error" not in r):
        images.append({"id": image_id, "file_name": rec["image"], "width": rec["width"], "height": rec["height"]})
        for d in rec["detections"]:
            x1, y1, x2, y2 = d["box"]
            annotations.append(
                {
                    "id": len(annotations),
                    "image_id": image_id,
                    "category_id": d["class_id"],
                    "bbox": [x1, y1, round(x2 - x1, 2), round(y2 - y1, 2)],
                    "area": round((x2 - x1) * (y2 - y1), 2),
                    "score": d["score"],
                    "iscrowd": 0,
                }
            )
    categories = [{"id": i, "name": n} for i, n in enumerate(names)]
    return {"images": images, "annotations": annotations, "categories": categories}


def predict_folder(
    detector: Detector,
    source: str,
    out: Path,
    params: DetectParams,
    *,
    batch: int = PREDICT_BATCH,
    resume: bool = False,
    save_images: Path | None = None,
    coco: Path | None = None,
    workers: int = 8,
    on_progress: Callable[[int, int], None] | None = None,
    vid_stride: int = 1,
    track: bool = False,
) -> FolderSummary:
    """Run the detector over every image and video of ``source``; JSON lines go to ``out`` as
    they finish (images first, then each video's frames, ``app.pipeline.video``)."""
    if batch < 1:
        raise InvalidParameter(f"batch must be >= 1, got {batch}")
    media = list_images(source, MEDIA_SUFFIXES)
    images = [m for m in media if not is_video(m.path)]
    videos = [m for m in media if is_video(m.path)]
    summary = FolderSummary()
    done = already_done(out) if resume else set()
    todo = [img for img in images if img.name not in done]
    summary.skipped = len(images) - len(todo)
    if on_progress:
        on_progress(0, len(todo))
    out.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    in_flight = detector.pipeline.max_in_flight

    def detect_chunk(chunk: list[tuple[SourceImage, Any]]) -> tuple[list, list[ImageResult]]:
        results = [ImageResult(error=x) if isinstance(x, YolopipeError) else None for _, x in chunk]
        ok = [i for i, res in enumerate(results) if res is None]
        if ok:
            for i, res in zip(ok, detector.detect([chunk[i][1] for i in ok], params)):
                results[i] = res
        return chunk, results

    chunks = _batches(detector, todo, batch, workers, ahead_batches=in_flight + 2)
    with open(out, "a" if resume else "w") as fh:
        if resume and not _ends_with_newline(out):
            fh.write("\n")  # a torn last line stays torn, on its own, instead of swallowing the next one
        for chunk, results in run_overlapped(detect_chunk, chunks, in_flight):
            lines = []
            for (img, _), res in zip(chunk, results):
                rec = res.to_json(img.name, detector.names)
                lines.append(json.dumps(rec))
                summary.images += 1
                if res.error is not None:
                    summary.errors += 1
                    summary.error_files.append(f"{img.name}: {res.error}")
                else:
                    summary.detections += len(res.detections or [])
                    if save_images is not None:
                        draw_detections(img.path, res, detector.names, Path(save_images) / img.name)
                if coco is not None:
                    records.append(rec)
            lines.append("")
            fh.write("\n".join(lines))
            fh.flush()
            if on_progress:
                on_progress(len(chunk), len(todo))
        if videos:
            _predict_videos(detector, videos, fh, params, summary, batch=batch, vid_stride=vid_stride, track=track,
                            resume_from=frames_done(out) if resume else {}, save_images=save_images,
                            records=records if coco is not None else None)
    if coco is not None:
        Path(coco).write_text(json.dumps(coco_document(records, detector.names)) + "\n")
    return summary


def _predict_videos(
    detector: Detector, videos: list[SourceImage], fh: Any, params: DetectParams, summary: FolderSummary, *,
    batch: int, vid_stride: int, track: bool, resume_from: dict[str, int], save_images: Path | None,
    records: list[dict[str, Any]] | None,
) -> None:
    """Each video's frames as JSON lines on ``fh`` (flushed per batch); ``--resume`` goes on after
    the last frame written; ``--save-images`` writes the annotated video as ``NAME.mp4``."""

    def write(rec: dict[str, Any]) -> None:
        fh.write(json.dumps(rec) + "\n")
        if records is not None and "error" not in rec:
            records.append({**rec, "image": f"{rec['image']}#{rec['frame']}"})

    for video in videos:
        save_to = Path(save_images) / f"{video.name}.mp4" if save_images is not None else None
        result = predict_video(
            detector, video.path, video.name, write, params, batch=batch, vid_stride=vid_stride,
            start=resume_from.get(video.name, -1) + 1, save_to=save_to,
            annotate=(lambda img, res: annotate(img, res, detector.names)) if save_to else None,
            on_frames=lambda _: fh.flush(), track=track,
        )
        fh.flush()
        summary.videos += 1
        summary.images += result.frames
        summary.detections += result.detections
        if result.error is not None:
            summary.images += 1
            summary.errors += 1
            summary.error_files.append(f"{video.name}: {result.error}")
