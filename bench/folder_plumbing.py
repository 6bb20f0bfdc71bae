"""What the folder path's host plumbing costs per image, with the GPU emulated (issue #16).

    python bench/folder_plumbing.py [--count 10000] [--batch 128] [--rounds 5] [--rate 7000] [--out FILE]
    python bench/folder_plumbing.py --real ...      # on a GPU machine: the torch-cuda detector

``predict_folder`` runs over ``--count`` JPEGs (copies of ``--images``, the 20 COCO photos of
the shared data by default) into a JSONL file, page cache warm, and so does main's image loop
(``bench/folder_baseline.py``, frozen at b5392d4) on the same folder, in interleaved rounds
(main, new, main, new, ...). Each round gives img/s, the process CPU time per image (every
thread: listing, reads, header checks, batching, rows to JSON lines, the writer) and, with the
stand-in pipeline, the share of the emulated device's time spent waiting for work.

The stand-in (``StandInPipeline``) implements ``app.contracts.Pipeline`` the way
``app.pipeline.gpu.GpuPipeline`` does for JPEG bytes: ``max_in_flight`` slots, the same
per-image host work before the device (``bytes()`` and the JPEG header read of
``GpuJpegDecoder.split``) and after it (a copy of each image's rows), and the device work of a
batch as one GIL-free wait: a single emulated device runs batches one after another at
``--rate`` images/s, queued in submission order, idle whenever no batch is queued. Its rows are
replayed: the sample model's real detections of each photo (ONNX Runtime on this CPU, once).

With ``--real`` the detector is ``open_detector("sample", backend="torch-cuda")`` and the
device idle share is not measured (the rates and CPU times are).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # `python bench/folder_plumbing.py`: make the repo importable
    sys.path.insert(0, str(REPO))

from app.contracts import DetectParams, PipelineRun
from app.errors import InvalidImage

SHARED_IMAGES = REPO.parent / "shared" / "data" / "images"


class EmulatedDevice:
    """One in-order queue of work: a batch starts when it is submitted or when the one before it
    ends, whichever is later, and lasts ``n / rate`` seconds; the caller waits for its end
    without the GIL (``time.sleep``), like a thread waiting on a CUDA event."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.first_start: float | None = None
            self.free_at = 0.0
            self.busy_s = 0.0
            self.idle_s = 0.0
            self.batches = 0

    def execute(self, n: int) -> None:
        if self.rate <= 0:  # no device time at all: what the host alone sustains
            return
        with self._lock:
            now = time.perf_counter()
            if self.first_start is None:
                self.first_start = start = now
            elif now > self.free_at:
                self.idle_s += now - self.free_at
                start = now
            else:
                start = self.free_at
            self.free_at = end = start + n / self.rate
            self.busy_s += n / self.rate
            self.batches += 1
        delay = end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def idle_share(self) -> float:
        span = self.free_at - (self.first_start or self.free_at)
        return self.idle_s / span if span > 0 else 0.0


class StandInPipeline:
    """``app.contracts.Pipeline`` for JPEG bytes with the device emulated and the rows replayed."""

    backend = "stand-in"
    precision = "fp16"
    decodes_jpeg = True

    def __init__(self, meta, replies: dict, *, rate: float, max_batch: int, slots: int = 3, max_det: int = 300,
                 host_work: bool = True) -> None:
        self.meta = meta
        self.max_batch = max_batch
        self.max_det = max_det
        self.max_in_flight = slots
        self.device = EmulatedDevice(rate)
        self._replies = replies
        self._slots = threading.BoundedSemaphore(slots)
        self._host_work = host_work

    def warmup(self, batches=None) -> None:
        """Nothing to capture."""

    def run(self, images, params: DetectParams) -> PipelineRun:
        from app.imaging.headers import read_jpeg_header

        with self._slots:
            results: list = [None] * len(images)
            datas = [bytes(x) for x in images]
            if self._host_work:  # GpuJpegDecoder.split reads every header again, holding the GIL
                for data in datas:
                    read_jpeg_header(data)
            self.device.execute(len(images))
            for i, data in enumerate(datas):
                reply = self._replies.get(_key(data))
                if reply is None:
                    results[i] = InvalidImage("not one of the replayed photos")
                else:
                    rows, lb = reply
                    results[i] = (rows.copy(), lb)
            return PipelineRun(results, {"batch": float(len(images))})

    def close(self) -> None:
        pass


def _key(data: bytes) -> tuple[int, bytes]:
    return len(data), data[-64:]


def replayed_rows(photos: list[tuple[str, bytes]], weights: str) -> tuple[object, dict]:
    """The sample model's NMS rows and letterbox of each photo (ONNX Runtime), keyed by its bytes."""
    from app.imaging.decode import decode_image
    from app.runtime import open_detector

    replies = {}
    with open_detector(weights, backend="onnxruntime", max_batch=1) as det:
        params = det.params()
        for _, data in photos:
            replies[_key(data)] = det.pipeline.run([decode_image(data)], params).images[0]
        meta = det.meta
    return meta, replies


MEDIAN_KEYS = ("img_per_s", "cpu_us_per_image", "wall_s", "device_idle_pct", "device_idle_between_batches_pct",
               "first_batch_ms", "after_last_batch_ms")


def run_round(variant: str, detector, folder: Path, out: Path, params, batch: int) -> dict:
    if variant == "main":
        from bench.folder_baseline import predict_folder as baseline

        run = lambda: baseline(detector, str(folder), out, params, batch=batch)
    else:
        from app.pipeline.folder import predict_folder

        run = lambda: vars(predict_folder(detector, str(folder), out, params, batch=batch))
    device = getattr(detector.pipeline, "device", None)
    if isinstance(device, EmulatedDevice):
        device.reset()
    cpu0, t0 = time.process_time(), time.perf_counter()
    summary = run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    n = summary["images"]
    row = {"variant": variant, "images": n, "errors": summary["errors"], "detections": summary["detections"],
           "wall_s": round(wall, 4), "img_per_s": round(n / wall, 1), "cpu_us_per_image": round(cpu / n * 1e6, 2)}
    if isinstance(device, EmulatedDevice) and device.rate > 0:
        end = t0 + wall
        row["device_idle_pct"] = round(100 * (1 - device.busy_s / wall), 2)  # of the whole run
        row["device_idle_between_batches_pct"] = round(100 * device.idle_share(), 2)  # first batch to last
        row["first_batch_ms"] = round((device.first_start - t0) * 1e3, 2)  # listing, first reads
        row["after_last_batch_ms"] = round((end - device.free_at) * 1e3, 2)  # its lines, the close
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=Path, default=SHARED_IMAGES, help="folder of JPEGs to copy")
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds (main then new in each)")
    ap.add_argument("--rates", default="7000,0",
                    help="the stand-in device's images/s, one scenario each; 0: no device time (the host's ceiling)")
    ap.add_argument("--variants", default="main,new", help="which loops run each round: main, new")
    ap.add_argument("--no-pipeline-host-work", action="store_true",
                    help="the stand-in skips GpuPipeline's per-image header read (device wait only)")
    ap.add_argument("--real", action="store_true", help="the torch-cuda detector instead of the stand-in")
    ap.add_argument("--weights", default="sample")
    ap.add_argument("--folder", type=Path, default=None, help="keep the copies here (reused when the count matches)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON")
    a = ap.parse_args()

    from app.benchmark.machine import machine_info, versions
    from app.benchmark.workloads import make_folder

    photos = [(p.name, p.read_bytes()) for p in sorted(a.images.iterdir()) if p.suffix.lower() in (".jpg", ".jpeg")]
    tmp = Path(tempfile.mkdtemp(prefix="yolopipe-folder-plumbing-"))
    folder = a.folder or tmp / "images"
    variants = a.variants.split(",")
    try:
        make_folder(folder, photos, a.count)
        if a.real:
            from app.runtime import open_detector

            detector = open_detector(a.weights, backend="torch-cuda", max_batch=a.batch)
            detector.pipeline.warmup()
        else:
            from app.pipeline.detector import Detector

            meta, replies = replayed_rows(photos, a.weights)
            detector = Detector(StandInPipeline(meta, replies, rate=0, max_batch=a.batch,
                                                host_work=not a.no_pipeline_host_work))
        params = detector.params()
        outs = {v: tmp / f"{v}.jsonl" for v in variants}
        for v in variants:  # warm: page cache, imports, graphs
            run_round(v, detector, folder, outs[v], params, a.batch)
        same = len({outs[v].read_bytes() for v in variants}) == 1
        rows = []
        rates = [None] if a.real else [float(r) for r in a.rates.split(",")]
        for rate in rates:
            if rate is not None:
                detector.pipeline.device.rate = rate
            for r in range(a.rounds):
                for v in variants:
                    row = {"rate": rate, "round": r, **run_round(v, detector, folder, outs[v], params, a.batch)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        detector.close()
        medians = {}
        for rate in rates:
            for v in variants:
                mine = [row for row in rows if row["variant"] == v and row["rate"] == rate]
                key = v if rate is None else f"{v} @ {'no device time' if rate <= 0 else f'{rate:g} img/s'}"
                medians[key] = {k: round(statistics.median(row[k] for row in mine), 2)
                                for k in MEDIAN_KEYS if k in mine[0]}
        result = {
            "what": "bench/folder_plumbing.py: predict_folder (new) vs main's image loop (bench/folder_baseline.py) "
                    f"over {a.count} page-cached JPEG copies of {len(photos)} photos → JSONL, batch {a.batch}, "
                    + ("the torch-cuda detector" if a.real else
                       f"stand-in pipeline: device emulated at {a.rates} img/s (0: none), 3 batches in flight, rows replayed "
                       "from the sample model" + ("" if a.no_pipeline_host_work else
                                                   ", GpuPipeline's per-image header read included")),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": {**machine_info(gpu=a.real), "nproc": os.cpu_count(), "cpu_model": _cpu_model(),
                        "note": "shared with other jobs" if not a.real else ""},
            "versions": versions(),
            "config": {"count": a.count, "batch": a.batch, "rounds": a.rounds, "rates": a.rates, "real": a.real,
                       "workers": 8, "pipeline_host_work": not a.no_pipeline_host_work},
            "outputs_identical": same,
            "medians": medians,
            "rounds": rows,
        }
        print(json.dumps({"medians": medians, "outputs_identical": same}), flush=True)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
