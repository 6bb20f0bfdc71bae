"""The image half of ``predict_folder`` as it was on main at b5392d4, frozen for the A/B rounds
of ``bench/folder_plumbing.py`` (issue #16): nothing but that bench imports it.

It is main's code unchanged apart from what the bench does not run (videos, ``--coco``,
``--save-images``, ``--resume``, progress), with ``run_overlapped`` copied in as it was, so the
baseline stays main's even as ``app.pipeline`` changes. It uses ``Detector.detect``,
``ImageResult.to_json`` and ``app.imaging``, which the new folder path leaves unchanged.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.contracts import DetectParams, ImageResult
from app.errors import InvalidImage, YolopipeError
from app.imaging.headers import IMAGE_SUFFIXES


@dataclass(frozen=True)
class SourceImage:
    path: Path
    name: str


def list_images(source: str) -> list[SourceImage]:
    """main's ``_walk`` (a folder only: what the bench passes)."""
    base = str(Path(source).expanduser())
    cut = len(base) + 1 if not base.endswith(os.sep) else len(base)
    found: list[tuple[str, str]] = []
    for folder, _, names in os.walk(base):
        for name in names:
            if os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES:
                full = os.path.join(folder, name)
                if os.path.isfile(full):
                    found.append((full[cut:].replace(os.sep, "/"), full))
    found.sort(key=lambda f: f[0].split("/"))
    return [SourceImage(Path(full), rel) for rel, full in found]


def run_overlapped(fn, items, depth: int) -> Iterator:
    if depth <= 1:
        for item in items:
            yield fn(item)
        return
    it = iter(items)
    with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="yolopipe-batch") as pool:
        pending: deque[Future] = deque()

        def submit_next() -> bool:
            for item in it:
                pending.append(pool.submit(fn, item))
                return True
            return False

        while len(pending) < depth and submit_next():
            pass
        while pending:
            result = pending.popleft().result()
            submit_next()
            yield result


def _read(img: SourceImage) -> bytes | YolopipeError:
    try:
        return img.path.read_bytes()
    except OSError as exc:
        return InvalidImage(f"cannot read file: {exc.strerror or exc}")


def _prepared(detector, img: SourceImage) -> Any:
    data = _read(img)
    if isinstance(data, YolopipeError):
        return data
    try:
        return detector.prepare(data)
    except YolopipeError as exc:
        return exc


def _prepared_chunk(detector, chunk: list[SourceImage]) -> list[Any]:
    return [_prepared(detector, img) for img in chunk]


def _batches(detector, images: list[SourceImage], batch: int, workers: int, ahead_batches: int):
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


def predict_folder(detector, source: str, out: Path, params: DetectParams, *, batch: int, workers: int = 8) -> dict:
    """main's image loop; returns its summary's counts."""
    todo = list_images(source)
    in_flight = detector.pipeline.max_in_flight

    def detect_chunk(chunk):
        results = [ImageResult(error=x) if isinstance(x, YolopipeError) else None for _, x in chunk]
        ok = [i for i, res in enumerate(results) if res is None]
        if ok:
            for i, res in zip(ok, detector.detect([chunk[i][1] for i in ok], params)):
                results[i] = res
        return chunk, results

    summary = {"images": 0, "errors": 0, "detections": 0, "error_files": []}
    chunks = _batches(detector, todo, batch, workers, ahead_batches=in_flight + 2)
    with open(out, "w") as fh:
        for chunk, results in run_overlapped(detect_chunk, chunks, in_flight):
            lines = []
            for (img, _), res in zip(chunk, results):
                lines.append(json.dumps(res.to_json(img.name, detector.names)))
                summary["images"] += 1
                if res.error is not None:
                    summary["errors"] += 1
                    summary["error_files"].append(f"{img.name}: {res.error}")
                else:
                    summary["detections"] += len(res.detections or [])
            lines.append("")
            fh.write("\n".join(lines))
            fh.flush()
    return summary
