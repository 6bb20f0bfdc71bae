"""What the Ray job's plumbing costs per image, without a detector: reads, actor output, driver writer.

    python bench/ray_plumbing.py [--count 20000] [--actors 1,2] [--batches-per-block 1,4] [--out FILE]

The question (issue 21): at two GPUs' rate (2 x ~5,000 img/s), is the one driver that writes
every line, or the read tasks, the limit? So the detector is replaced by ``CannedActor``: a
``DetectorActor`` whose detector answers every image at once with the same real-sized result
(``--boxes`` detections), so everything else the job does per image is what is measured.

Two parts, each image's cost as CPU time:

* ``stage`` rows, in this process, no Ray: ``read`` (``read_batch`` on the folder, page cache
  warm), ``actor_output`` (``record_table``: JSON lines and Arrow columns, an actor's host work
  besides detecting) and ``driver_write`` (``write_records`` into a JSONL file). ``us_per_image``
  and ``img_per_s_per_core`` = 1e6 / that: the rate one core sustains doing only that stage.
* ``ray`` rows: the whole job (``detect_tables`` + ``write_records``, the code ``predict --ray``
  runs) with 1, 2, ... canned actors on a local Ray; ``img_per_s`` in steady state (after the
  first written block) and the driver's CPU time per image over it (``driver_cpu_us_per_image``:
  this process, every thread: Ray Data's executor, fetching blocks, the writer).
  ``driver_cores_at_10k`` = the cores the driver needs at 10,000 img/s.

On a small shared CPU the ``ray`` rows' rates are bounded by the machine (every process shares
its cores), so they are a smoke figure; the per-image CPU times are the finding.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # `python bench/ray_plumbing.py`: make the repo importable
    sys.path.insert(0, str(REPO))

import numpy as np

from app.benchmark.machine import PACKAGES, machine_info, versions
from app.contracts import DetectedBatch
from app.distributed.actor import DetectorActor, read_batch

SHARED_IMAGES = REPO.parent / "shared" / "data" / "images"
NAMES = ["Normal", "Fall"]


def canned_result(boxes: int) -> DetectedBatch:
    """One 640x480 image's answer with ``boxes`` boxes, as the detector gives it: arrays."""
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 500, (boxes, 2)).astype(np.float32)
    wh = rng.uniform(10, 140, (boxes, 2)).astype(np.float32)
    scores = np.sort(rng.uniform(0.25, 1, boxes).astype(np.float32))[::-1]
    class_ids = rng.integers(0, len(NAMES), boxes).astype(np.float32)
    rows = np.column_stack([xy, xy + wh, scores, class_ids]).astype(np.float32)
    return DetectedBatch(np.array([640]), np.array([480]), np.array([boxes]), rows)


class CannedDetector:
    """Answers every image with one fixed result, at no cost: only the plumbing around it is left."""

    def __init__(self, boxes: int) -> None:
        self.names = NAMES
        self.result = canned_result(boxes)

    def run(self, items, params=None):
        return self.result.take([0] * len(items))


class CannedActor(DetectorActor):
    def __init__(self, *, boxes: int) -> None:  # no model: see CannedDetector
        self.detector = CannedDetector(boxes)
        self.params = None


def make_source(images: Path, files: int, count: int, dest: Path):
    """``count`` images (names) over ``files`` real JPEG files in ``dest``, each read ``count/files`` times:
    the reads are of a warm page cache, as a GPU host's are once a folder has been read."""
    from app.distributed.sources import ImageSource, open_source

    photos = sorted(p for p in images.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not photos:
        raise SystemExit(f"no JPEG images in {images}")
    dest.mkdir(parents=True)
    for i in range(files):
        shutil.copyfile(photos[i % len(photos)], dest / f"{i:06d}.jpg")
    src = open_source(str(dest))
    items = [(f"{i:07d}.jpg", src.items[i % len(src.items)][1]) for i in range(count)]
    return ImageSource(src.filesystem, items, local=True)


# ------------------------------------------------------------------- stages, in this process
def cpu_us_per_image(fn, images: int, rounds: int) -> float:
    """Best of ``rounds``: CPU microseconds per image of ``fn()`` (which handles ``images``)."""
    best = float("inf")
    for _ in range(rounds):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best / images * 1e6


def stage_rows(src, batch: int, boxes: int, workdir: Path, rounds: int) -> list[dict]:
    import pyarrow as pa

    from app.distributed.job import write_records
    from app.distributed.output import open_sink
    from app.predict.folder import FolderSummary

    items = src.items[: batch * 16]
    listing = [pa.table({"image": [n for n, _ in items[i : i + batch]], "path": [p for _, p in items[i : i + batch]]})
               for i in range(0, len(items), batch)]
    actor = CannedActor(boxes=boxes)
    read = [read_batch(t, filesystem=src.filesystem) for t in listing]
    records = [actor(t) for t in read]

    def write() -> None:
        sink = open_sink(workdir / "stage.jsonl", "jsonl", resume=False)
        write_records(iter(records), sink, set(), FolderSummary(), len(items), None)
        sink.close()

    costs = {
        "read": cpu_us_per_image(lambda: [read_batch(t, filesystem=src.filesystem) for t in listing], len(items), rounds),
        "actor_output": cpu_us_per_image(lambda: [actor(t) for t in read], len(items), rounds),
        "driver_write": cpu_us_per_image(write, len(items), rounds),
    }
    line_bytes = records[0].column("line").nbytes / records[0].num_rows
    return [{"part": "stage", "stage": k, "us_per_image": round(v, 2), "img_per_s_per_core": round(1e6 / v),
             "images": len(items), "batch": batch, "boxes": boxes, "line_bytes": round(line_bytes)}
            for k, v in costs.items()]


# --------------------------------------------------------------------------- the Ray job
def ray_row(src, actors: int, batch: int, boxes: int, workdir: Path) -> dict:
    import ray

    from app.distributed import job
    from app.distributed.job import ActorPlan, block_size, detect_tables, write_records
    from app.distributed.output import open_sink
    from app.predict.folder import FolderSummary

    todo = list(src.items)
    mark: dict = {}
    done = [0]

    def on_progress(n: int, total: int) -> None:
        done[0] += n
        if "t0" not in mark and n:  # steady state starts now: every process has started
            mark.update(t0=time.perf_counter(), n0=done[0], cpu0=time.process_time())
        mark.update(t1=time.perf_counter(), cpu1=time.process_time())

    ray.init(num_cpus=max(4, actors + 2), include_dashboard=False, logging_level="WARNING")
    try:
        plan = ActorPlan(actors, gpu=False, backend="canned")
        sink = open_sink(workdir / f"ray-{actors}.jsonl", "jsonl", resume=False)
        summary = FolderSummary()
        t_start = time.perf_counter()
        tables = detect_tables(ray, src, todo, plan, batch, CannedActor, {"boxes": boxes}, quiet=True)
        write_records(tables, sink, set(), summary, len(todo), on_progress)
        sink.close()
        t_end = time.perf_counter()
    finally:
        ray.shutdown()
    steady = done[0] - mark["n0"]
    driver_us = (mark["cpu1"] - mark["cpu0"]) / steady * 1e6 if steady else float("nan")
    driver_cores = (mark["cpu1"] - mark["cpu0"]) / (mark["t1"] - mark["t0"]) if steady else float("nan")
    lines = (workdir / f"ray-{actors}.jsonl").read_text().splitlines()
    assert len(lines) == len({json.loads(line)["image"] for line in lines}) == summary.images == len(todo)
    rate = steady / (mark["t1"] - mark["t0"]) if steady else float("nan")
    return {"part": "ray", "actors": actors, "images": len(todo), "steady_images": steady,
            "img_per_s": round(rate, 1), "wall_s": round(t_end - t_start, 2), "batch": batch, "boxes": boxes,
            "block_images": block_size(len(todo), batch, actors), "batches_per_block": job.BATCHES_PER_BLOCK,
            "driver_cpu_us_per_image": round(driver_us, 1), "driver_cores": round(driver_cores, 3),
            "driver_cores_at_10k": round(driver_us * 1e-6 * 10_000, 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, default=SHARED_IMAGES, help="JPEGs to copy")
    p.add_argument("--count", type=int, default=20_000, help="images (names) in the job")
    p.add_argument("--files", type=int, default=500, help="distinct JPEG files they are read from")
    p.add_argument("--batches-per-block", default="4", help="Ray rows for each (app.distributed.job.BATCHES_PER_BLOCK)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--boxes", type=int, default=10, help="detections in the canned result of every image")
    p.add_argument("--actors", default="1,2", help="canned actors per Ray row")
    p.add_argument("--rounds", type=int, default=3, help="stage rows: best of this many")
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from app.distributed import job

    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="yolopipe-ray-plumbing-"))
    try:
        src = make_source(args.images, args.files, args.count, workdir / "images")
        rows = stage_rows(src, args.batch, args.boxes, workdir, args.rounds)
        for row in rows:
            print(json.dumps(row), file=sys.stderr, flush=True)
        for per_block in (int(b) for b in args.batches_per_block.split(",")):
            job.BATCHES_PER_BLOCK = per_block
            for actors in (int(a) for a in args.actors.split(",")):
                rows.append(ray_row(src, actors, args.batch, args.boxes, workdir))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "machine": {**machine_info(), "load_average": os.getloadavg()},
        "versions": versions((*PACKAGES, "ray", "pyarrow")),
        "config": {"images_from": str(args.images), "count": args.count, "files": args.files, "batch": args.batch, "boxes": args.boxes,
                   "actors": args.actors, "rounds": args.rounds,
                   "date": dt.datetime.now().isoformat(timespec="seconds"),
                   "elapsed_s": round(time.perf_counter() - t0, 1)},
        "note": args.note,
        "rows": rows,
    }
    out = args.out or REPO / "bench" / "results" / f"{dt.date.today()}-cpu-ray-plumbing.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
