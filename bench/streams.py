"""Many cameras on one machine: N copies of one clip as N streams, yolopipe and Ultralytics.

For each N in ``--streams``:

* yolopipe ``realtime``: every copy played at the clip's own frame rate, as a camera would
  (``app.pipeline.streams``, newest frames win when the model is behind); ``realtime`` is true
  when every stream kept its source rate with p99 read-to-result latency ≤ 100 ms and < 1 %
  of its frames dropped.
* yolopipe as fast as possible: every copy read at full speed (files never drop).
* both for each decoder of ``--video-decode`` (``nvdec``: NVDEC frames straight into the GPU
  pipeline's NV12 graphs; ``opencv``: OpenCV on the CPU, frames uploaded); each row says its
  ``decoder``.
* Ultralytics' own multi-stream predict on a ``.streams`` list of the same files, in a
  subprocess, its model warmed up first. Its stream threads read each file as fast as they
  decode, keeping only the newest frame, and end with the files: ``fps`` is the frames it
  processed over its wall time, ``dropped_pct`` the frames of the files it never processed.
  Its latency is not observable from outside (``null``).

Writes one JSON file: machine, versions, config, rows. The lead runs it on the GPU machine::

    python3 bench/streams.py --clip .vid/dance-1080p30.mp4 --streams 8,16,32,64,96 --video-decode nvdec,opencv \
        --nvdec-ceiling --out $OUT/streams.json

``--nvdec-ceiling`` adds, per N, NVDEC + the NV12 letterbox kernel alone (no model): the
ceiling of the GPU decode path, which the as-fast-as-possible NVDEC rows are held to.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without `pip install -e`

import cv2
import numpy as np

from app.benchmark.machine import machine_info, versions
from app.config import MAX_WAIT_MS

LATENCY_LIMIT_MS = 100.0
DROP_LIMIT_PCT = 1.0


def clip_facts(clip: Path) -> tuple[int, int, float, int]:
    cap = cv2.VideoCapture(str(clip), cv2.CAP_FFMPEG)
    facts = (int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)),
             float(cap.get(cv2.CAP_PROP_FPS)), int(cap.get(cv2.CAP_PROP_FRAME_COUNT)))
    cap.release()
    return facts


def yolopipe_row(detector, clip: Path, n: int, *, realtime: bool, source_fps: float, max_wait_ms: float) -> dict:
    from app.pipeline.streams import StreamRunner

    lock = threading.Lock()
    done = [0]

    def on_frames(frames, answers, track_ids) -> None:
        with lock:
            done[0] += len(frames)

    runner = StreamRunner(detector, detector.params(), on_frames, max_wait_ms=max_wait_ms, max_streams=n)
    decoder = runner.decoder  # app.pipeline.sources.video_decoder: what reads every stream here
    t0 = time.perf_counter()
    streams = [runner.add(str(clip), realtime=realtime) for _ in range(n)]
    runner.run(until_done=True)
    wall = time.perf_counter() - t0
    latencies = np.concatenate([np.asarray(s.stats.latencies_s) for s in streams]) * 1e3
    dropped = sum(s.stats.dropped for s in streams)
    seen = sum(s.stats.frames_done + s.stats.dropped for s in streams)
    read_fps = [s.stats.frames_read / wall for s in streams]  # did decoding keep every camera's rate?
    p99 = float(np.percentile(latencies, 99)) if latencies.size else None
    dropped_pct = 100.0 * dropped / seen if seen else 0.0
    kept_rate = min(read_fps) >= 0.95 * source_fps
    return {
        "system": "yolopipe", "streams": n, "mode": "realtime" if realtime else "as_fast_as_possible",
        "decoder": decoder,
        "realtime": bool(realtime and kept_rate and p99 is not None and p99 <= LATENCY_LIMIT_MS
                         and dropped_pct < DROP_LIMIT_PCT),
        "fps": round(done[0] / wall, 1), "p99_latency_ms": round(p99, 2) if p99 is not None else None,
        "p50_latency_ms": round(float(np.percentile(latencies, 50)), 2) if latencies.size else None,
        "dropped_pct": round(dropped_pct, 3), "frames": done[0], "wall_s": round(wall, 2),
        "min_stream_read_fps": round(min(read_fps), 2),
        "failed_streams": sum(s.state == "failed" for s in streams),
    }


def nvdec_row(clip: Path, n: int, imgsz: int, batch: int = 16) -> dict:
    """NVDEC + the NV12 letterbox kernel alone (no model): N decoders as threads of this process,
    each file read once as fast as possible; ``fps`` is letterboxed frames per second."""
    try:
        import torch
        from numba import cuda

        from app.gpu.nvdec import NvdecReader
    except Exception as exc:  # noqa: BLE001 - a row that says why, not a crash of the whole run
        return {"system": "yolopipe-nvdec-letterbox", "streams": n, "error": f"{type(exc).__name__}: {exc}"}
    counts, errors = [0] * n, []

    def decode(k: int) -> None:
        try:
            stream = torch.cuda.Stream()
            reader = NvdecReader(str(clip), batch=batch)
            out = cuda.device_array((batch, 3, imgsz, imgsz), np.float32)
            staging = None
            pending = []
            for frame in reader.frames():
                pending.append(frame)
                if len(pending) < batch:
                    continue
                staging = _letterbox(pending, staging, out, stream, imgsz)
                counts[k] += len(pending)
                pending = []
            if pending:
                _letterbox(pending, staging, out, stream, imgsz)
                counts[k] += len(pending)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=decode, args=(k,)) for k in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    row = {"system": "yolopipe-nvdec-letterbox", "streams": n, "mode": "as_fast_as_possible", "realtime": False,
           "fps": round(sum(counts) / wall, 1), "p99_latency_ms": None, "dropped_pct": 0.0, "frames": sum(counts),
           "wall_s": round(wall, 2), "note": "decode + NV12 letterbox only, no model"}
    if errors:
        row["error"] = errors[0]
    return row


def _letterbox(frames, staging, out, stream, imgsz):
    """The frames device-to-device into one staging buffer, then one launch of the NV12 kernel."""
    import torch
    from numba import cuda

    from app.gpu.nv12 import NV12_PARAMS, fill_nv12_params, launch_nv12_letterbox
    from app.imaging.letterbox import letterbox_params

    sizes = [f.planes.numel() for f in frames]
    if staging is None or staging.numel() < sum(sizes):
        staging = torch.empty(sum(sizes) * 2, dtype=torch.uint8, device="cuda")
    host = np.zeros((len(frames), NV12_PARAMS), np.int64)
    offset = 0
    with torch.cuda.stream(stream):
        for j, (f, size) in enumerate(zip(frames, sizes)):
            staging[offset : offset + size].copy_(f.planes.reshape(-1), non_blocking=True)
            rows, cols = f.planes.shape  # the surface may hold more rows than the picture shows
            fill_nv12_params(host[j], letterbox_params(f.height, f.width, imgsz), offset, cols, rows * 2 // 3)
            offset += size
        params = torch.from_numpy(host).to("cuda")
        launch = cuda.external_stream(stream.cuda_stream)
        launch_nv12_letterbox(cuda.as_cuda_array(staging), cuda.as_cuda_array(params), out, len(frames), launch)
    stream.synchronize()  # the decoder may reuse these surfaces for its next frames
    return staging


def ultralytics_worker(args: argparse.Namespace) -> None:
    """In a subprocess: Ultralytics' own predict over a .streams list for ``--seconds``, one JSON line out."""
    import os

    os.environ.setdefault("YOLO_OFFLINE", "1")
    import numpy as np
    from ultralytics import YOLO

    model = YOLO(args.ultralytics_weights)
    # Warm the model up first, as ours is: its load is not part of the streams' time.
    model.predict(np.zeros((args.imgsz, args.imgsz, 3), np.uint8), imgsz=args.imgsz, half=args.half,
                  device=args.device, verbose=False)
    frames = 0
    t0 = time.perf_counter()  # its stream threads start inside predict: they count, as ours do
    for _ in model.predict(source=args.streams_file, stream=True, imgsz=args.imgsz, half=args.half,
                           device=args.device, verbose=False, conf=0.25, iou=0.7):
        frames += 1  # one Results per frame
        if time.perf_counter() - t0 >= args.seconds:
            break
    wall = time.perf_counter() - t0
    print(json.dumps({"frames": frames, "wall_s": wall}), flush=True)
    os._exit(0)  # its stream threads are not daemons everywhere: do not wait for them


def ultralytics_row(args: argparse.Namespace, clip: Path, n: int, source_fps: float, frames_per_clip: int) -> dict:
    seconds = 3 * frames_per_clip / source_fps + 60  # a cap only: it ends when its files do
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "cams.streams"
        listing.write_text("".join(f"{clip.resolve()}\n" for _ in range(n)))
        cmd = [sys.executable, __file__, "--ultralytics-worker", "--streams-file", str(listing),
               "--ultralytics-weights", args.ultralytics_weights, "--seconds", str(seconds),
               "--imgsz", str(args.imgsz), "--device", args.device] + (["--half"] if args.half else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 600, check=False)
        except subprocess.TimeoutExpired:
            return {"system": "ultralytics", "streams": n, "error": "timed out"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"system": "ultralytics", "streams": n, "error": proc.stderr[-500:]}
    got = json.loads(lines[-1])
    fps = got["frames"] / got["wall_s"] if got["wall_s"] else 0.0
    # Its stream threads read each file once, keeping only their newest frame: what it skipped is dropped.
    shortfall = max(0.0, 100.0 * (1 - got["frames"] / (n * frames_per_clip)))
    return {
        "system": "ultralytics", "streams": n, "mode": "ultralytics_streams",
        "realtime": bool(shortfall < DROP_LIMIT_PCT and fps / n >= 0.95 * source_fps), "fps": round(fps, 1),
        "p99_latency_ms": None, "dropped_pct": round(shortfall, 3),
        "dropped_pct_method": "frames not processed of those the files hold",
        "frames": got["frames"], "wall_s": round(got["wall_s"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clip", type=Path, default=Path("../shared/data/video/dance-1080p30.mp4"))
    ap.add_argument("--streams", default="8,16,32,64")
    ap.add_argument("--weights", default="sample")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-wait-ms", type=float, default=MAX_WAIT_MS, help="the stream runner's wait for a batch "
                                                                           "(default: yolopipe's, app.config)")
    ap.add_argument("--compile", action="store_true", help="torch-cuda: torch.compile each batch bucket first "
                                                            "(~20 s each on a first run)")
    ap.add_argument("--no-ultralytics", action="store_true")
    ap.add_argument("--video-decode", default="auto", help="comma-separated: auto | nvdec | opencv; the yolopipe "
                                                            "rows run once per decoder")
    ap.add_argument("--nvdec-ceiling", action="store_true", help="also NVDEC + the NV12 letterbox kernel alone, "
                                                                  "per N (needs PyNvVideoCodec and a GPU)")
    ap.add_argument("--out", type=Path, default=Path("streams.json"))
    # the Ultralytics subprocess
    ap.add_argument("--ultralytics-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--streams-file", help=argparse.SUPPRESS)
    ap.add_argument("--ultralytics-weights", default="", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="0", help=argparse.SUPPRESS)
    ap.add_argument("--half", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ultralytics_worker:
        ultralytics_worker(args)
        return

    from app.pipeline.detector import Detector
    from app.runtime import open_detector

    width, height, source_fps, frames_per_clip = clip_facts(args.clip)
    counts = [int(n) for n in args.streams.split(",")]
    detector = open_detector(args.weights, backend=args.backend, precision=args.precision, imgsz=args.imgsz,
                             max_batch=args.max_batch, compile=args.compile)
    info = detector.info()
    gpu = info["backend"] != "onnxruntime"
    if not args.ultralytics_weights:
        from app.runtime import export_model

        args.ultralytics_weights = str(export_model(args.weights, imgsz=args.imgsz) / "weights.pt")
    args.device, args.half = ("0", info["precision"] == "fp16") if gpu else ("cpu", False)
    detector.pipeline.warmup()
    rows = []
    common = {"input": "streams", "width": width, "height": height, "source_fps": round(source_fps, 3)}
    with detector:
        for n in counts:
            for decoder in args.video_decode.split(","):
                reading = Detector(detector.pipeline, detector.shape, video_decode=decoder)  # the same pipeline
                for realtime in (True, False):
                    row = yolopipe_row(reading, args.clip, n, realtime=realtime, source_fps=source_fps,
                                       max_wait_ms=args.max_wait_ms)
                    rows.append({**common, **row, "backend": info["backend"], "precision": info["precision"]})
                    print(json.dumps(rows[-1]), flush=True)
            if args.nvdec_ceiling:
                rows.append({**common, **nvdec_row(args.clip, n, args.imgsz)})
                print(json.dumps(rows[-1]), flush=True)
            if not args.no_ultralytics:
                rows.append({**common, **ultralytics_row(args, args.clip, n, source_fps, frames_per_clip)})
                print(json.dumps(rows[-1]), flush=True)
    doc = {
        "machine": machine_info(gpu=gpu), "versions": versions(),
        "config": {"clip": args.clip.name, "frames_per_clip": frames_per_clip, "weights": args.weights,
                   "model": info["model"], "imgsz": args.imgsz, "compile": args.compile, "max_batch": args.max_batch,
                   "max_wait_ms": args.max_wait_ms, "video_decode": args.video_decode,
                   "decode": "one reader thread per stream (OpenCV/FFmpeg on the CPU, or NVDEC: see each row)",
                   "latency_limit_ms": LATENCY_LIMIT_MS, "drop_limit_pct": DROP_LIMIT_PCT},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
