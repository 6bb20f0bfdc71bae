"""Many cameras on one machine: N copies of one clip as N streams, yolopipe and a baseline.

A row is **real time** when every copy is read at >= 95 % of the clip's own rate (first to last
frame), the p99 read-to-result latency is <= 100 ms and < 0.1 % of the frames are dropped.
Modes (``--modes``, default ``ceiling,nvdec,opencv,ultralytics,nvdec_max,fidelity``) run in the
order given; every row is written to ``--out`` as soon as it is measured, and a mode (or count)
that would start after ``--budget-s`` is skipped and named in the file's ``skipped``:

* ``ceiling``: NVDEC + the NV12 letterbox alone (no model): ``--ceiling-streams`` files read as
  fast as possible through the runner's decode pool, for each pool size of ``--ceiling-threads``
  (``YOLOPIPE_NVDEC_THREADS``; 0: the default), file reader of ``--ceiling-readers``
  (``YOLOPIPE_NVDEC_READER``) and decode call size of ``--ceiling-batches``; with
  ``--no-compile`` no engine is built first (the model is not used).
* ``nvdec``: every copy played at the clip's rate through NVDEC at each count of
  ``--nvdec-streams``; ``opencv``: the same through OpenCV at ``--opencv-streams``.
* ``ultralytics``: the baseline, Ultralytics' best case in a subprocess: ``model.predict`` on N
  decoded frames of the clip per tick (decode excluded), N = the largest real-time count so far
  (else ``--ultralytics-streams``); real time when its ticks keep the clip's rate.
* ``nvdec_max``: each count of ``--nvdec-more`` while the last NVDEC count tried held real time:
  ``max_realtime_streams``.
* ``fidelity``: ``bench/streams_fidelity.py``'s GPU row for the clip (NVDEC's model input and
  detections against OpenCV's decode).
* ``track``: the largest real-time count again with ``--track``: what tracking costs.
* ``fast``: yolopipe as fast as possible (files never drop) at ``--fast-streams`` with each
  decoder of ``--video-decode``.

Rows: ``system``, ``input: "streams"``, ``streams``, ``width``, ``height``, ``source_fps``,
``realtime``, ``limit`` (a paced row not in real time: the stage that held it back, ``decode``
or ``model``), ``decoder``, ``fps`` (frames processed per second over all streams),
``p99_latency_ms``, ``dropped_pct``, and what each mode adds. On the GPU machine:
``bash tools/device/run.sh streams`` (tools/device/README.md). A CPU smoke run:

    python3 bench/streams.py --clip clip.mp4 --modes opencv,fast --opencv-streams 2 --fast-streams 2 \\
        --video-decode opencv --max-batch 4 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without `pip install -e`

import cv2
import numpy as np

from app.benchmark.machine import machine_info, versions

LATENCY_LIMIT_MS = 100.0
DROP_LIMIT_PCT = 0.1
RATE_SHARE = 0.95
MODES = ("ceiling", "nvdec", "opencv", "ultralytics", "nvdec_max", "fidelity", "track", "fast")


def clip_facts(clip: Path) -> tuple[int, int, float, int]:
    cap = cv2.VideoCapture(str(clip), cv2.CAP_FFMPEG)
    facts = (int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)),
             float(cap.get(cv2.CAP_PROP_FPS)), int(cap.get(cv2.CAP_PROP_FRAME_COUNT)))
    cap.release()
    return facts


def is_realtime(read_fps: list[float], p99: float | None, dropped_pct: float, source_fps: float) -> bool:
    return bool(read_fps and min(read_fps) >= RATE_SHARE * source_fps and p99 is not None
                and p99 <= LATENCY_LIMIT_MS and dropped_pct < DROP_LIMIT_PCT)


@contextlib.contextmanager
def environment(**values: str | None):
    """``os.environ`` with ``values`` set (None: unset) for the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def runner_row(detector, clip: Path, n: int, *, realtime: bool, source_fps: float, max_wait_ms: float,
               track: bool = False, detect=None, system: str = "yolopipe", decode_batch: int | None = None) -> dict:
    """N copies of ``clip`` through one ``StreamRunner``; ``detect`` (a callable taking a batch of
    frames) replaces the model after the runner chose its decoder as for the detector;
    ``decode_batch``: the frames one NVDEC decode call asks for (the decode pool's, 8)."""
    from app.predict.streams import StreamRunner

    lock = threading.Lock()
    done = [0]

    def on_frames(frames, answers, track_ids) -> None:
        with lock:
            done[0] += len(frames)

    runner = StreamRunner(detector, detector.params(), on_frames, max_wait_ms=max_wait_ms, max_streams=n,
                          track=track)
    if detect is not None:
        runner._detect_frames = detect  # the decode path alone: no model after the letterbox
    if decode_batch and runner.pool is not None:
        runner.pool.batch = decode_batch
    t0 = time.perf_counter()
    streams = [runner.add(str(clip), realtime=realtime) for _ in range(n)]
    runner.run(until_done=True)
    wall = time.perf_counter() - t0
    latencies = np.concatenate([np.asarray(s.stats.latencies_s) for s in streams]) * 1e3
    dropped = sum(s.stats.dropped for s in streams)
    seen = sum(s.stats.frames_done + s.stats.dropped for s in streams)
    read_fps = [s.stats.read_fps() for s in streams]
    p99 = float(np.percentile(latencies, 99)) if latencies.size else None
    dropped_pct = 100.0 * dropped / seen if seen else 0.0
    failed = [s for s in streams if s.state == "failed"]
    realtime_row = realtime and not failed and is_realtime(read_fps, p99, dropped_pct, source_fps)
    return {
        "system": system, "streams": n, "mode": "realtime" if realtime else "as_fast_as_possible",
        "decoder": runner.decoder, "track": track,
        "realtime": realtime_row,
        "limit": None if realtime_row or not realtime else limiting_stage(read_fps, source_fps, failed),
        "fps": round(done[0] / wall, 1), "p99_latency_ms": round(p99, 2) if p99 is not None else None,
        "p50_latency_ms": round(float(np.percentile(latencies, 50)), 2) if latencies.size else None,
        "dropped_pct": round(dropped_pct, 3), "frames": done[0], "wall_s": round(wall, 2),
        "min_stream_read_fps": round(min(read_fps), 2) if read_fps else None,
        "failed_streams": len(failed), "errors": sorted({str(s.error) for s in failed})[:3],
        "decode_threads": runner.pool.size if runner.pool is not None else runner.decode_threads,
        "reader": os.environ.get("YOLOPIPE_NVDEC_READER", "simple") if runner.decoder == "nvdec" else None,
        "decode_batch": runner.pool.batch if runner.pool is not None else None,
        "switch_interval_s": sys.getswitchinterval(),
    }


def limiting_stage(read_fps: list[float], source_fps: float, failed: list) -> str:
    """Which stage kept a paced row from real time: ``failed`` (a stream failed), ``decode`` (a
    stream was read slower than its rate: its reader fell behind), else ``model`` (frames were
    read in time, but batches did not keep up: latency or drops)."""
    if failed:
        return "failed"
    if read_fps and min(read_fps) < RATE_SHARE * source_fps:
        return "decode"
    return "model"


class LetterboxOnly:
    """A stream runner's batch step that does what the GPU pipeline does to a batch of NVDEC frames
    up to the engine (each frame device to device into a staging buffer, the NV12 letterbox kernel
    into a model input, app.gpu.nv12_input) and nothing after: the ceiling of the decode path."""

    def __init__(self, device: int, size: int, max_batch: int) -> None:
        import torch
        from numba import cuda

        self.torch, self.cuda = torch, cuda
        self.device, self.size, self.max_batch = device, size, max_batch
        self.local = threading.local()  # the runner overlaps batches on threads: each its own buffers

    def buffers(self) -> threading.local:
        local = self.local
        if not hasattr(local, "stream"):
            local.stream = self.torch.cuda.Stream(device=self.device)
            local.staging = self.torch.empty(0, dtype=self.torch.uint8, device=f"cuda:{self.device}")
            local.out = self.cuda.device_array((self.max_batch, 3, self.size, self.size), np.float32)
        return local

    def __call__(self, frames) -> object:
        from app.contracts import DetectedBatch
        from app.gpu.nv12 import launch_nv12_letterbox
        from app.gpu.nv12_input import copy_frames, frames_offset, params_view, plan_frames, write_params

        results: list = [None] * len(frames)
        own = self.buffers()
        plan = plan_frames(frames, self.device, 0, self.max_batch, self.size, results)
        if own.staging.numel() < plan.end:
            own.staging = self.torch.empty(plan.end * 2, dtype=self.torch.uint8, device=f"cuda:{self.device}")
        host = np.zeros(frames_offset(0, self.max_batch), np.uint8)
        write_params(host, 0, self.max_batch, plan, len(plan))
        params = np.ascontiguousarray(params_view(host, 0, self.max_batch)[: len(plan)])
        copy_frames(own.staging, plan, own.stream)
        launch = self.cuda.external_stream(own.stream.cuda_stream)
        launch_nv12_letterbox(self.cuda.as_cuda_array(own.staging), self.cuda.to_device(params, stream=launch),
                              own.out, len(plan), launch)
        own.stream.synchronize()  # the decoder may reuse the frames' surfaces after this
        n = len(frames)
        return DetectedBatch(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64),
                             np.zeros((0, 6), np.float32), {i: r for i, r in enumerate(results) if r is not None})


def ultralytics_worker(args: argparse.Namespace) -> None:
    """In a subprocess: Ultralytics' predict on ``--ultralytics-n`` decoded frames of the clip per
    tick for ``--seconds`` (decode excluded: its best case), one JSON line out."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    from ultralytics import YOLO

    cap, frames = cv2.VideoCapture(str(args.clip), cv2.CAP_FFMPEG), []
    while len(frames) < args.ultralytics_n and (got := cap.read())[0]:
        frames.append(got[1])
    cap.release()
    frames = [frames[k % len(frames)] for k in range(args.ultralytics_n)]
    model = YOLO(args.ultralytics_weights)
    kw = {"imgsz": args.imgsz, "half": args.half, "device": args.device, "verbose": False, "conf": 0.25, "iou": 0.7}
    model.predict(frames[: min(len(frames), 8)], **kw)  # warmed up, as ours is
    ticks, tick_s = 0, []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        t = time.perf_counter()
        for k in range(0, len(frames), args.max_batch):
            model.predict(frames[k : k + args.max_batch], **kw)
        tick_s.append(time.perf_counter() - t)
        ticks += 1
    print(json.dumps({"ticks": ticks, "wall_s": time.perf_counter() - t0,
                      "p99_tick_ms": float(np.percentile(np.asarray(tick_s) * 1e3, 99))}), flush=True)
    os._exit(0)


def ultralytics_row(args: argparse.Namespace, n: int, *, source_fps: float, gpu: bool, half: bool,
                    seconds: float) -> dict:
    from app.runtime import OpenOptions, export_model

    weights = export_model(OpenOptions(args.weights, imgsz=args.imgsz)) / "weights.pt"
    cmd = [sys.executable, __file__, "--ultralytics-worker", "--clip", str(args.clip), "--ultralytics-n", str(n),
           "--ultralytics-weights", str(weights), "--seconds", str(seconds), "--imgsz", str(args.imgsz),
           "--max-batch", str(args.max_batch), "--device", "0" if gpu else "cpu"] + (["--half"] if half else [])
    row = {"system": "ultralytics", "streams": n, "mode": "ultralytics_best_case", "decoder": None,
           "method": "model.predict on N decoded frames of the clip per tick, in batches of max_batch; decode "
                     "excluded; no RTSP loopback here"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 240, check=False)
    except subprocess.TimeoutExpired:
        return {**row, "error": "timed out"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**row, "error": proc.stderr[-500:]}
    got = json.loads(lines[-1])
    fps = n * got["ticks"] / got["wall_s"] if got["wall_s"] else 0.0
    return {**row, "realtime": fps >= RATE_SHARE * n * source_fps, "fps": round(fps, 1),
            "p99_latency_ms": round(got["p99_tick_ms"], 2), "latency_method": "a tick's N frames, predict only",
            "dropped_pct": None, "wall_s": round(got["wall_s"], 2)}


class Run:
    """The run's rows, written to ``out`` after each one; what the budget left out named."""

    def __init__(self, args: argparse.Namespace, common: dict) -> None:
        self.args, self.common, self.rows, self.skipped = args, common, [], []
        self.t0 = time.monotonic()
        self.doc: dict = {}

    def fits(self, what: str, seconds: float) -> bool:
        """Whether ``what`` (about ``seconds`` long) starts within the budget; named if not."""
        left = self.args.budget_s - (time.monotonic() - self.t0)
        if left < seconds:
            self.skipped.append({"what": what, "left_s": round(left, 1)})
            self.write()
            return False
        return True

    def guarded(self, measure, *args, extra: dict | None = None, **kwargs) -> dict:
        """``measure``'s row, or a row with its error: one failure does not end the run."""
        try:
            row = measure(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a row that says why
            row = {"system": getattr(measure, "__name__", "?"), "error": f"{type(exc).__name__}: {exc}"}
        return self.add({**row, **(extra or {})})

    def add(self, row: dict) -> dict:
        row = {**self.common, **row, "at_s": round(time.monotonic() - self.t0, 1)}
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.write()
        return row

    def write(self) -> None:
        self.doc["rows"], self.doc["skipped"] = self.rows, self.skipped
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.doc, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clip", type=Path, default=Path("../shared/data/video/dance-1080p30.mp4"))
    ap.add_argument("--modes", default="ceiling,nvdec,opencv,ultralytics,nvdec_max,fidelity",
                    help=f"comma-separated, run in this order: {', '.join(MODES)}")
    ap.add_argument("--nvdec-streams", default="64,128", help="nvdec: the counts tried")
    ap.add_argument("--nvdec-more", default="160,192,224,256", help="nvdec_max: each while the last nvdec count held real time")
    ap.add_argument("--opencv-streams", default="16")
    ap.add_argument("--ceiling-streams", type=int, default=128)
    ap.add_argument("--ceiling-threads", default="0", help="ceiling: decode pool sizes (0: the default)")
    ap.add_argument("--ceiling-readers", default="simple", help="ceiling: simple, threaded")
    ap.add_argument("--ceiling-batches", default="8", help="ceiling: frames per NVDEC decode call")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="the interpreter's thread switch interval for the run, in s (0: Python's, 0.005)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="the eager model (no engine build): for runs that measure decoding alone")
    ap.add_argument("--ultralytics-streams", type=int, default=128, help="when no count was real time")
    ap.add_argument("--ultralytics-seconds", type=float, default=15.0)
    ap.add_argument("--fast-streams", default="64")
    ap.add_argument("--video-decode", default="nvdec,opencv", help="fast: the decoders of its rows")
    ap.add_argument("--weights", default="sample")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-wait-ms", type=float, default=None, help="the stream runner's wait for a batch to fill "
                                                                     "(default: yolopipe's, app.config)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no mode or count starts after this many seconds")
    ap.add_argument("--out", type=Path, default=Path("streams.json"))
    # the Ultralytics subprocess
    ap.add_argument("--ultralytics-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ultralytics-n", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ultralytics-weights", default="", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="0", help=argparse.SUPPRESS)
    ap.add_argument("--half", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ultralytics_worker:
        ultralytics_worker(args)
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    from app.config import MAX_WAIT_MS
    from app.contracts import RunShape
    from app.runtime import OpenOptions, ensure_artifacts, open_model_dir

    max_wait = MAX_WAIT_MS if args.max_wait_ms is None else args.max_wait_ms
    width, height, source_fps, frames_per_clip = clip_facts(args.clip)
    run = Run(args, {"input": "streams", "width": width, "height": height, "source_fps": round(source_fps, 3)})
    t_open = time.monotonic()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    options = OpenOptions(args.weights, backend=args.backend, precision=args.precision, imgsz=args.imgsz,
                          compile=args.compile, shape=RunShape(max_batch=args.max_batch))
    detector = open_model_dir(ensure_artifacts(options), options)
    info = detector.info()
    gpu = info["backend"] != "onnxruntime"
    device = detector.device or 0
    detector.warmup()
    run.doc = {"machine": machine_info(gpu=gpu), "versions": versions(),
               "config": {"clip": args.clip.name, "frames_per_clip": frames_per_clip, "weights": args.weights,
                          "model": info["model"], "backend": info["backend"], "precision": info["precision"],
                          "imgsz": args.imgsz, "max_batch": args.max_batch, "max_wait_ms": max_wait, "modes": modes,
                          "latency_limit_ms": LATENCY_LIMIT_MS, "drop_limit_pct": DROP_LIMIT_PCT,
                          "rate_share": RATE_SHARE, "open_s": round(time.monotonic() - t_open, 1)},
               "max_realtime_streams": {}}
    run.write()
    reading = {d: detector.reshaped(video_decode=d) for d in ("nvdec", "opencv")}
    clip_s = frames_per_clip / source_fps
    found = {"nvdec": 0, "opencv": 0}  # the largest real-time counts

    def paced(decoder: str, n: int) -> bool:
        row = run.guarded(runner_row, reading[decoder], args.clip, n, realtime=True, source_fps=source_fps,
                          max_wait_ms=max_wait)
        if row.get("realtime"):
            found[decoder] = max(found[decoder], n)
        run.doc["max_realtime_streams"] = found
        return bool(row.get("realtime"))

    def ceiling() -> None:
        for reader in args.ceiling_readers.split(","):
            for threads in [int(t) for t in args.ceiling_threads.split(",")]:
                for batch in [int(b) for b in args.ceiling_batches.split(",")]:
                    if not run.fits(f"ceiling {reader} {threads} {batch}", clip_s):
                        return
                    with environment(YOLOPIPE_NVDEC_THREADS=str(threads) if threads else None,
                                     YOLOPIPE_NVDEC_READER=reader):
                        run.guarded(runner_row, reading["nvdec"], args.clip, args.ceiling_streams, realtime=False,
                                    source_fps=source_fps, max_wait_ms=max_wait, system="yolopipe-nvdec-letterbox",
                                    detect=LetterboxOnly(device, args.imgsz, args.max_batch), decode_batch=batch,
                                    extra={"reader": reader, "note": "NVDEC + NV12 letterbox only, no model"})

    def counts(decoder: str, listed: str) -> None:
        for n in [int(c) for c in listed.split(",") if c]:
            if run.fits(f"{decoder} {n}", clip_s + 10):
                paced(decoder, n)

    def nvdec_max() -> None:  # larger counts while the last one tried held real time
        for n in [int(c) for c in args.nvdec_more.split(",") if c]:
            tried = [r for r in run.rows if r.get("decoder") == "nvdec" and r.get("mode") == "realtime"]
            if (tried and not tried[-1].get("realtime")) or not run.fits(f"nvdec {n}", clip_s + 10):
                return
            paced("nvdec", n)

    def fidelity() -> None:
        from bench.streams_fidelity import gpu_row

        run.guarded(gpu_row, args.clip, detector, limit=None)

    def track() -> None:
        count = found["nvdec"] if gpu else found["opencv"]
        if count:
            run.guarded(runner_row, reading["nvdec" if gpu else "opencv"], args.clip, count, realtime=True,
                        source_fps=source_fps, max_wait_ms=max_wait, track=True)

    def ultralytics() -> None:
        count = (found["nvdec"] if gpu else found["opencv"]) or args.ultralytics_streams
        run.guarded(ultralytics_row, args, count, source_fps=source_fps, gpu=gpu,
                    half=info["precision"] in ("fp16", "int8"), seconds=args.ultralytics_seconds)

    def fast() -> None:
        for n in [int(c) for c in args.fast_streams.split(",") if c]:
            for decoder in args.video_decode.split(","):
                if (decoder != "nvdec" or gpu) and run.fits(f"fast {decoder} {n}", clip_s):
                    run.guarded(runner_row, reading[decoder], args.clip, n, realtime=False, source_fps=source_fps,
                                max_wait_ms=max_wait)

    plan = {  # mode: (what it runs, seconds it needs to start, needs a GPU)
        "ceiling": (ceiling, clip_s, True),
        "nvdec": (lambda: counts("nvdec", args.nvdec_streams), clip_s + 10, True),
        "opencv": (lambda: counts("opencv", args.opencv_streams), clip_s + 10, False),
        "ultralytics": (ultralytics, args.ultralytics_seconds + 30, False),
        "nvdec_max": (nvdec_max, clip_s + 10, True),
        "fidelity": (fidelity, 30, True),
        "track": (track, clip_s + 10, False),
        "fast": (fast, clip_s, False),
    }
    with detector:
        for mode in modes:
            measure, seconds, needs_gpu = plan[mode]
            if (gpu or not needs_gpu) and run.fits(mode, seconds):
                measure()
    run.write()
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
