"""What the folder path's host plumbing costs per image, with the GPU emulated (issue #16).

    python bench/folder_plumbing.py [--count 10000] [--batch 128] [--rounds 5] [--rates 7000,0] [--out FILE]
    python bench/folder_plumbing.py --real [--rounds 3] [--out FILE]   # on a GPU machine: torch-cuda

``predict_folder`` runs over ``--count`` JPEGs (copies of ``--images``, the 20 COCO photos of
the shared data by default) into a JSONL file, page cache warm, in interleaved rounds of its
variants. Each round gives img/s, the process CPU time per image (every thread: listing, reads, header
checks, batching, rows to JSON lines, the writer) and, with the stand-in pipeline, the share of
the run the emulated device had no work (``device_idle_pct``; ``*_between_batches_pct``: from
its first batch to its last), and when its first batch came and how long after its last the
run ended. ``outputs_identical``: every variant wrote the same bytes.

Variants: ``kept-heap`` (``predict_folder`` as ``yolopipe predict`` runs it: after
``keep_freed_heap``) and ``default-heap`` (the same without it). That setting is process-wide,
so with the stand-in every round of every variant runs in a fresh process (a warm run, then one
timed run per ``--rates`` entry). ``--real`` keeps one detector in this process: the
default-heap rounds first, then the kept-heap ones. (Issue #16's rounds against main's earlier
loop, frozen at b5392d4, and what they found: ``bench/results/README.md``.)

The stand-in (``StandInPipeline``) implements ``app.contracts.Pipeline`` the way
``app.pipeline.gpu.GpuPipeline`` does for JPEG bytes: ``in_flight`` batch slots, the same
per-image host work before the device (``bytes()`` and the JPEG header read of
``GpuJpegDecoder.split``) and after it (a copy of each image's rows), and the device work of a
batch as one GIL-free wait: a single emulated device runs batches one after another at the
rate, queued in submission order, idle whenever no batch is queued; rate 0: no device time,
what the host alone sustains. Its rows are replayed: the sample model's real detections of
each photo (ONNX Runtime on this CPU, once).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # `python bench/folder_plumbing.py`: make the repo importable
    sys.path.insert(0, str(REPO))

from app.contracts import DetectParams, Diagnostics, PipelineRun, RunFacts
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
    letterbox = "square"  # as a GPU pipeline's (rows are replayed: the placement is never made)
    cuda = None  # no CUDA device: the device is emulated (``emulated``)

    def __init__(self, meta, replies: dict, *, rate: float, max_batch: int, slots: int = 3, max_det: int = 300,
                 host_work: bool = True) -> None:
        self.meta = meta
        self.max_batch = max_batch
        self.max_det = max_det
        self.in_flight = slots
        self.buckets: tuple[int, ...] = ()
        self.takes_nv12 = False
        self.emulated = EmulatedDevice(rate)
        self._replies = replies
        self._slots = threading.BoundedSemaphore(slots)
        self._host_work = host_work

    def warmup(self, batches=None, *, nv12: bool = False, frame_size=None) -> None:
        """Nothing to capture."""

    def run(self, images, params: DetectParams, *, decode: str | None = None) -> PipelineRun:
        from app.imaging.headers import read_jpeg_header

        with self._slots:
            results: list = [None] * len(images)
            datas = [x.data for x in images]  # EncodedImage: the bytes with the header read once
            if self._host_work:  # GpuJpegDecoder.split reads every header again, holding the GIL
                for data in datas:
                    read_jpeg_header(data)
            self.emulated.execute(len(images))
            for i, data in enumerate(datas):
                reply = self._replies.get(_key(data))
                if reply is None:
                    results[i] = InvalidImage("not one of the replayed photos")
                else:
                    rows, lb = reply
                    results[i] = (rows.copy(), lb)
            return PipelineRun(results, facts=RunFacts(len(images), len(images)))

    def diagnose(self, *, decode=None, profile=None, bare=None, measure=None, timeline=False) -> Diagnostics:
        """Facts only: no engine to profile or time alone."""
        return Diagnostics("stand-in", False, "stand-in", False, "no CUDA graphs: the device is emulated")

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
            # the pipeline's own rows (input pixels) and letterbox: what StandInPipeline replays
            replies[_key(data)] = det.pipeline.run([decode_image(data)], params).images[0]
        meta = det.meta
    return meta, replies


MEDIAN_KEYS = ("img_per_s", "cpu_us_per_image", "wall_s", "device_idle_pct", "device_idle_between_batches_pct",
               "first_batch_ms", "after_last_batch_ms")


def run_round(variant: str, detector, folder: Path, out: Path, params, batch: int,
              device: EmulatedDevice | None = None) -> dict:
    """``device``: the stand-in pipeline's emulated device, whose idle time is reported too."""
    from app.predict.folder import predict_folder

    run = lambda: vars(predict_folder(detector, str(folder), out, params, batch=batch))
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


VARIANTS = {
    "kept-heap": "predict_folder as yolopipe predict runs it (keep_freed_heap called first)",
    "default-heap": "predict_folder with glibc's heap thresholds left as they are (keep_freed_heap off)",
}
REAL_VARIANTS = ["default-heap", "kept-heap"]  # keep_freed_heap cannot be undone in a process


def _rows_of_child(a, variant: str, replies: Path, folder: Path, out: Path) -> list[dict]:
    """One round of one variant in a fresh process: the heap setting of ``predict_folder`` is
    process-wide, so no variant inherits another's."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--replies", str(replies),
           "--folder", str(folder), "--batch", str(a.batch), "--rates", a.rates, "--jsonl", str(out)]
    if a.no_pipeline_host_work:
        cmd.append("--no-pipeline-host-work")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} round failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def child(a) -> None:
    """``--child VARIANT``: a warm run, then one timed run per rate, a JSON line each."""
    import app.predict.folder as folder_module
    from app.pipeline.detector import Detector

    if a.child == "kept-heap":  # as yolopipe predict does, once per process
        folder_module.keep_freed_heap()
    meta, replies = pickle.loads(a.replies.read_bytes())
    pipeline = StandInPipeline(meta, replies, rate=0, max_batch=a.batch, host_work=not a.no_pipeline_host_work)
    detector = Detector(pipeline)
    params = detector.params()
    for k, rate in enumerate(float(r) for r in a.rates.split(",")):
        pipeline.emulated.rate = rate
        if k == 0:  # warm: imports, first allocations
            run_round(a.child, detector, a.folder, a.jsonl, params, a.batch, pipeline.emulated)
        row = run_round(a.child, detector, a.folder, a.jsonl, params, a.batch, pipeline.emulated)
        print(json.dumps({"rate": rate, **row, "variant": a.child}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=Path, default=SHARED_IMAGES, help="folder of JPEGs to copy")
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds (each variant once per round, in turn)")
    ap.add_argument("--rates", default="7000,0",
                    help="the stand-in device's images/s, one scenario each; 0: no device time (the host's ceiling)")
    ap.add_argument("--variants", default=None,
                    help=f"which loops run each round, of {', '.join(VARIANTS)} (default: both; --real: both, "
                         "default-heap first)")
    ap.add_argument("--no-pipeline-host-work", action="store_true",
                    help="the stand-in skips GpuPipeline's per-image header read (device wait only)")
    ap.add_argument("--real", action="store_true", help="the torch-cuda detector instead of the stand-in")
    ap.add_argument("--real-backend", default="torch-cuda", help="--real's backend (onnxruntime: a smoke test on a CPU)")
    ap.add_argument("--weights", default="sample")
    ap.add_argument("--folder", type=Path, default=None, help="keep the copies here (reused when the count matches)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--replies", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)

    from app.benchmark.machine import cpu_model, machine_info, versions
    from app.benchmark.workloads import make_folder

    photos = [(p.name, p.read_bytes()) for p in sorted(a.images.iterdir()) if p.suffix.lower() in (".jpg", ".jpeg")]
    tmp = Path(tempfile.mkdtemp(prefix="yolopipe-folder-plumbing-"))
    folder = a.folder or tmp / "images"
    variants = REAL_VARIANTS if a.real else (a.variants or ",".join(VARIANTS)).split(",")
    rows: list[dict] = []
    try:
        make_folder(folder, photos, a.count)
        outs = {v: tmp / f"{v}.jsonl" for v in variants}
        if a.real:
            rates: list = [None]
            rows, same = _real_rounds(a, folder, outs)
        else:
            rates = [float(r) for r in a.rates.split(",")]
            replies = tmp / "replies.pkl"
            replies.write_bytes(pickle.dumps(replayed_rows(photos, a.weights)))
            for r in range(a.rounds):
                for v in variants:
                    for row in _rows_of_child(a, v, replies, folder, outs[v]):
                        rows.append({"round": r, **row})
                        print(json.dumps(rows[-1]), flush=True)
                if r == 0:
                    same = len({outs[v].read_bytes() for v in variants}) == 1
        medians = {}
        for rate in rates:
            for v in variants:
                mine = [row for row in rows if row["variant"] == v and row["rate"] == rate]
                key = v if rate is None else f"{v} @ {'no device time' if rate <= 0 else f'{rate:g} img/s'}"
                medians[key] = {k: round(statistics.median(row[k] for row in mine), 2)
                                for k in MEDIAN_KEYS if k in mine[0]}
        result = {
            "what": f"bench/folder_plumbing.py: {', '.join(f'{v} = {VARIANTS[v]}' for v in variants)}; "
                    f"over {a.count} page-cached JPEG copies of {len(photos)} photos → JSONL, batch {a.batch}, "
                    + (f"the {a.real_backend} detector, every round in this process: default-heap, then kept-heap"
                       if a.real else
                       f"stand-in pipeline: device emulated at {a.rates} img/s (0: none), 3 batches in flight, rows "
                       "replayed from the sample model" + ("" if a.no_pipeline_host_work else
                                                            ", GpuPipeline's per-image header read included")
                       + "; each round of each variant in a fresh process (a warm run, then one timed run per rate)"),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": {**machine_info(gpu=a.real and a.real_backend != "onnxruntime"), "nproc": os.cpu_count(), "cpu_model": cpu_model(),
                        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
                        "note": "" if a.real else "shared with other jobs"},
            "versions": versions(),
            "code": _git_head(),
            "config": {"count": a.count, "batch": a.batch, "rounds": a.rounds, "rates": a.rates, "real": a.real and a.real_backend,
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


def _real_rounds(a, folder: Path, outs: dict[str, Path]) -> tuple[list[dict], bool]:
    """``--real``: one detector in this process (torch-cuda; the graphs of the folder's two batch
    sizes captured first): rounds with glibc's heap as it is, then with ``keep_freed_heap`` in
    effect, which no process can undo."""
    import app.predict.folder as folder_module
    from app.runtime import open_detector

    rows = []
    keep = folder_module.keep_freed_heap
    with open_detector(a.weights, backend=a.real_backend, max_batch=a.batch) as detector:
        detector.warmup([a.batch, a.count % a.batch or a.batch])  # the two sizes the folder's batches have
        params = detector.params()
        for v in REAL_VARIANTS:
            if v == "kept-heap":
                keep()  # as yolopipe predict does; no process can undo it
            run_round(v, detector, folder, outs[v], params, a.batch)  # warm: page cache, imports, first allocations
            for r in range(a.rounds):
                row = run_round(v, detector, folder, outs[v], params, a.batch)
                rows.append({"rate": None, "round": r, **row, "variant": v})
                print(json.dumps(rows[-1]), flush=True)
    return rows, len({out.read_bytes() for out in outs.values()}) == 1


def _git_head() -> str:
    """The checkout's commit, where it is a git checkout (a copy on a GPU machine may not be)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "app"], capture_output=True,
                               text=True, check=False).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + (" + changes in app/" if head and dirty else "")


if __name__ == "__main__":
    main()
