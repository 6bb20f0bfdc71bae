"""Folder inference end to end, yolopipe and Ultralytics on the same folder in the same run.

yolopipe: ``predict_folder`` (what ``yolopipe predict DIR`` runs): file reads in threads,
decode, inference with batches in flight, one JSON line per image written to a file.
Ultralytics: ``YOLO.predict(DIR, stream=True)`` with the same batch size (the detector's
``RunShape.max_batch``, as ``predict_folder``'s); it writes nothing.
The folder holds ``folder_images`` copies of the run's JPEGs, in a temporary directory that is
removed afterwards.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from app.benchmark.baseline import ultralytics_folder_row
from app.benchmark.workloads import make_folder


def folder_rows(detector, weights: Path, images, n_images: int, gpu: bool, ultralytics: bool,
                max_ultralytics_s: float, log) -> list[dict]:
    from app.predict.folder import predict_folder

    batch = detector.shape.max_batch
    tmp = Path(tempfile.mkdtemp(prefix="yolopipe-bench-folder-"))
    rows = []
    try:
        folder = make_folder(tmp / "images", images, n_images)
        out = tmp / "predictions.jsonl"
        params = detector.params()
        predict_folder(detector, str(folder), out, params)  # warm: page cache, graphs
        t0 = time.perf_counter()
        summary = predict_folder(detector, str(folder), out, params)
        wall = time.perf_counter() - t0
        lines = sum(1 for _ in out.open())
        read_s = _read_only_s(folder)
        rows.append({"system": "yolopipe", "backend": detector.backend, "precision": detector.precision,
                     "input": "folder", "batch": batch, "mode": "folder",
                     "decode": detector.diagnose().decoder if gpu else "opencv", "images": summary.images,
                     "errors": summary.errors, "detections": summary.detections, "jsonl_lines": lines,
                     "wall_s": round(wall, 3), "img_per_s": round(summary.images / wall, 1), "p50_ms": None,
                     "read_only_s": round(read_s, 3), "read_only_img_per_s": round(summary.images / read_s, 1),
                     "p99_ms": None, "in_flight": detector.shape.in_flight,
                     "timing": "predict_folder: reads, decode, inference, JSONL written (yolopipe predict DIR)"})
        log(f"  yolopipe folder: {summary.images} images in {wall:.2f} s = {rows[-1]['img_per_s']} img/s "
            f"(listing and reading the files alone: {read_s:.2f} s)")
        if ultralytics:
            r = ultralytics_folder_row(weights, folder, n_images, batch, detector.precision if gpu else "fp32",
                                       0 if gpu else "cpu", max_ultralytics_s)
            rows.append(r)
            log(f"  Ultralytics folder: {r['images']} images in {r['wall_s']:.2f} s = {r['img_per_s']} img/s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _read_only_s(folder: Path, workers: int = 8) -> float:
    """Listing and reading every file as predict_folder does, nothing else: the folder's floor
    on this machine's file system (a VM's disk can be it, page cache or not)."""
    from concurrent.futures import ThreadPoolExecutor

    from app.files import list_images

    def read(part):
        return sum(len(img.path.read_bytes()) for img in part)

    t0 = time.perf_counter()
    images = list_images(str(folder))
    with ThreadPoolExecutor(workers) as pool:
        sum(pool.map(read, [images[k::workers] for k in range(workers)]))
    return time.perf_counter() - t0
