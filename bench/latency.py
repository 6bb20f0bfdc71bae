"""yolopipe latency/throughput benchmark: Ultralytics ``predict`` vs yolopipe, in one run.

    python bench/latency.py [--quick] [--images DIR] [--out FILE.json] [--batches 1,8] ...

Rows (one per measurement, see bench/README.md): Ultralytics FP16/FP32 (GPU when present,
else CPU FP32); yolopipe per available backend (onnxruntime; torch-cuda fp16/fp32 on a GPU;
TensorRT when installed and an engine is built); input from decoded frames and from JPEG
bytes; p50/p99 per batch call (``mode: "serial"``); on the GPU the CUDA-event split per stage
(profiling path) and the host dispatch per batch; throughput with ``--lanes`` pipeline lanes
driven by ``--threads`` host threads (``mode: "pipelined"``, frames and JPEG with nvJPEG or
CPU decode); the bare engine in a CUDA graph and the bare ONNX Runtime session
(``system: "bare"``); NMS alone at batch 1 and 16 with conf 0.25 and 0.001.

The most important parts run first (torch-cuda fp16, then ONNX Runtime, Ultralytics,
torch-cuda fp32, NMS); a part that would start past ``--budget-s`` is skipped and listed in
``failures``, and a row or part that fails is recorded there too: the run never dies as a whole.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # `python bench/latency.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.machine import machine_info as common_machine_info
from bench.machine import versions

os.environ.setdefault("YOLO_OFFLINE", "1")

GPU_BATCHES = (1, 8, 32, 128)
CPU_BATCHES = (1, 8)
NMS_BATCHES = (1, 16)
NMS_CONFS = (0.25, 0.001)


# ---------------------------------------------------------------------------- the machine
def has_gpu() -> bool:
    from app.gpu.probe import cuda_device_count

    return cuda_device_count() > 0


def machine_info(gpu: bool) -> dict:
    info = common_machine_info()
    if gpu:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


# ------------------------------------------------------------------------------- images
def load_images(images_dir: Path | None) -> list[tuple[str, bytes]]:
    """``(name, JPEG bytes)``: the folder's JPEGs, else Ultralytics' assets + generated variants."""
    import cv2

    if images_dir is not None:
        files = sorted(p for p in Path(images_dir).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
        if not files:
            raise SystemExit(f"no JPEG images in {images_dir}")
        return [(p.name, p.read_bytes()) for p in files]
    import ultralytics

    assets = Path(ultralytics.__file__).parent / "assets"
    out = []
    for name in ("bus.jpg", "zidane.jpg"):
        data = (assets / name).read_bytes()
        out.append((name, data))
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        for tag, variant in (
            ("640", _fit(img, 640)),
            ("480-flip", _fit(img[:, ::-1], 480)),
            ("1280", _fit(img, 1280)),
        ):
            ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(variant), [cv2.IMWRITE_JPEG_QUALITY, 90])
            assert ok
            out.append((f"{Path(name).stem}-{tag}.jpg", buf.tobytes()))
    return out


def _fit(img: np.ndarray, side: int) -> np.ndarray:
    import cv2

    h, w = img.shape[:2]
    r = side / max(h, w)
    return cv2.resize(img, (max(1, round(w * r)), max(1, round(h * r))), interpolation=cv2.INTER_AREA)


def batch_of(items: list, n: int) -> list:
    return [items[i % len(items)] for i in range(n)]

# ------------------------------------------------------------------------------ timing
class Budget:
    """Wall-clock budget of the whole run: parts start only while enough is left, and timed
    loops stop early (after ``MIN_ITERS``) once a row has used its share or the run its budget."""

    MIN_ITERS = 3

    def __init__(self, seconds: float, row_max_s: float) -> None:
        self.start = time.perf_counter()
        self.seconds = float(seconds)
        self.row_max_s = float(row_max_s)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def row_deadline(self) -> float:
        return time.perf_counter() + max(0.0, min(self.row_max_s, self.left()))


BUDGET = Budget(float("inf"), float("inf"))  # main() replaces it


def measure(fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
    """Wall time (ms) of ``iters`` calls after ``warmup``; cut short by the row's time share."""
    deadline = BUDGET.row_deadline()
    for _ in range(warmup):
        fn()
        if time.perf_counter() > deadline:
            break
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times.append((t1 - t0) * 1e3)
        if t1 > deadline and len(times) >= Budget.MIN_ITERS:
            break
    return times


def row(system: str, backend: str, precision: str, input_: str, batch: int, times_ms: list[float], **extra) -> dict:
    times = sorted(times_ms)
    p50 = statistics.median(times)
    p99 = float(np.percentile(times, 99))
    mean = statistics.fmean(times)
    return {
        "system": system,
        "backend": backend,
        "precision": precision,
        "input": input_,
        "batch": batch,
        "p50_ms": round(p50, 4),
        "p99_ms": round(p99, 4),
        "img_per_s": round(batch * 1e3 / mean, 1) if mean > 0 else None,
        "iters": len(times),
        **extra,
    }


def median_of(dicts: list[dict], key: str) -> float | None:
    vals = [d[key] for d in dicts if key in d]
    return round(statistics.median(vals), 4) if vals else None


def best_batch(rows: list[dict], default: int = 32) -> int:
    """The batch of the highest pipelined frames throughput among ``rows`` (``default`` if none)."""
    cands = [r for r in rows if r.get("mode") == "pipelined" and r["input"] == "frames" and r.get("img_per_s")]
    return max(cands, key=lambda r: r["img_per_s"])["batch"] if cands else default


def overhead_pct(value_ms: float, bare_ms: float) -> float | None:
    """How much slower ``value_ms`` is than ``bare_ms``, in percent of the bare time."""
    return round((value_ms - bare_ms) / bare_ms * 100.0, 2) if bare_ms > 0 else None


# ------------------------------------------------------------------------ Ultralytics
def bench_ultralytics(weights: Path, images, batches, precisions, device, iters, warmup, tick) -> list[dict]:
    import cv2
    from ultralytics import YOLO

    rows = []
    frames = [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for _, d in images]
    datas = [d for _, d in images]
    for precision in precisions:
        model = YOLO(str(weights))
        quant = precision  # Ultralytics' `quantize` ("fp16" | "fp32") replaced `half`
        for b in batches:
            fr, by = batch_of(frames, b), batch_of(datas, b)

            def on_frames(fr=fr, model=model, quant=quant):
                return model.predict(fr, imgsz=640, rect=False, conf=0.25, iou=0.7, quantize=quant, device=device, verbose=False)

            def on_jpeg(by=by, model=model, quant=quant):
                decoded = [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for d in by]
                return model.predict(decoded, imgsz=640, rect=False, conf=0.25, iou=0.7, quantize=quant, device=device, verbose=False)

            for input_, fn in (("frames", on_frames), ("jpeg", on_jpeg)):
                times = measure(fn, iters, warmup)
                speed = fn()[0].speed  # Ultralytics' own per-image split of the last call (ms)
                rows.append(
                    row("ultralytics", "torch" if device != "cpu" else "torch-cpu", precision, input_, b, times,
                        ultralytics_speed_ms={k: round(v, 4) for k, v in speed.items()})
                )
                tick()
    return rows

# ------------------------------------------------------------------------------ yolopipe
def decoded_frames(images) -> list[np.ndarray]:
    import cv2

    return [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for _, d in images]


def bench_detector(detector, label: tuple[str, str], images, batches, iters, warmup, tick, gpu: bool) -> list[dict]:
    """Serial latency: frames and JPEG bytes through the one detector API, one call at a time;
    on the GPU also the stage split (profiling path)."""
    backend, precision = label
    frames = decoded_frames(images)
    datas = [d for _, d in images]
    pipeline = detector.pipeline
    params = detector.params()
    rows = []
    for b in batches:
        for input_, items in (("frames", batch_of(frames, b)), ("jpeg", batch_of(datas, b))):
            timings: list[dict] = []

            def call(items=items, timings=timings):
                detector.detect(items, params)
                timings.append(dict(getattr(pipeline, "last_timings", {})))

            times = measure(call, iters, warmup)
            extra: dict = {"mode": "serial"}
            if hasattr(pipeline, "jpeg_decode") and input_ == "jpeg":
                extra["decode"] = pipeline.jpeg_decode
            host = timings[-len(times):]
            for key in ("dispatch_us", "decode_ms", "pack_ms", "device_pack_us", "wait_ms", "preprocess_ms",
                        "engine_ms", "nms_ms", "raw_launch"):
                v = median_of(host, key)
                if v is not None:
                    extra[f"host_{key}_p50"] = v
            if getattr(pipeline, "last_launch_path", ""):
                extra["launch"] = pipeline.last_launch_path
            if gpu and hasattr(pipeline, "run"):
                # The stage split: the profiling path (per-stage graphs with CUDA events between).
                prepared = [detector.prepare(x) for x in items]
                prof = []
                for _ in range(max(3, min(iters // 2, len(times)))):
                    pipeline.run(prepared, params, profile=True)
                    prof.append(dict(pipeline.last_timings))
                for key in ("gpu_decode_ms", "gpu_pack_ms", "gpu_h2d_ms", "gpu_preprocess_ms", "gpu_engine_ms",
                            "gpu_nms_ms", "gpu_d2h_ms", "gpu_total_ms"):
                    v = median_of(prof, key)
                    if v is not None:
                        extra[f"{key}_p50"] = v
            rows.append(row("yolopipe", backend, precision, input_, b, times, **extra))
            tick()
    return rows


def bench_pipelined(detector, label: tuple[str, str], items: list, input_: str, batch: int, n_images: int,
                    threads: int, decode: str | None) -> dict:
    """Throughput: ``threads`` host threads call ``detector.detect`` on batches of ``batch``
    until ``n_images`` images are done; the pipeline's lanes overlap their host and GPU work.
    ``img_per_s`` is images / wall time of the whole run; p50/p99 are per batch call."""
    import itertools
    import threading

    backend, precision = label
    pipeline = detector.pipeline
    params = detector.params()
    n_batches = max(threads, -(-n_images // batch))
    # A few distinct batches (rotated inputs), so consecutive batches are not byte-identical.
    variants = [[items[(k * 7 + i) % len(items)] for i in range(batch)] for k in range(min(4, n_batches))]
    latencies: list[float] = []
    errors: list[str] = []
    next_batch = itertools.count()  # next() on a count is atomic under the GIL

    def worker() -> None:
        while True:
            k = next(next_batch)
            if k >= n_batches:
                return
            t0 = time.perf_counter()
            try:
                out = detector.detect(variants[k % len(variants)], params)
            except Exception as exc:  # noqa: BLE001 - recorded in the row
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            latencies.append((time.perf_counter() - t0) * 1e3)
            errors.extend(str(r.error) for r in out if r.error is not None)

    # Untimed: one concurrent round, so every lane has run this bucket (graphs captured).
    warm = [threading.Thread(target=lambda v=v: detector.detect(v, params)) for v in variants[:threads]]
    for t in warm:
        t.start()
    for t in warm:
        t.join()
    workers = [threading.Thread(target=worker, name=f"bench-{i}") for i in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    wall = time.perf_counter() - t0
    if not latencies:
        raise RuntimeError(f"no batch completed: {errors[0] if errors else 'unknown'}")
    done = len(latencies) * batch
    r = row("yolopipe", backend, precision, input_, batch, latencies, mode="pipelined",
            lanes=getattr(pipeline, "num_lanes", 1), threads=threads, images=done, wall_s=round(wall, 3))
    r["img_per_s"] = round(done / wall, 1) if wall > 0 and done else None
    if decode is not None:
        r["decode"] = decode
    if errors:
        r["errors"] = len(errors)
        r["first_error"] = errors[0][:300]
    return r


def bench_bare_torch(engine, meta, images, batch: int, iters: int, warmup: int) -> dict:
    """The engine alone in a CUDA graph on a letterboxed batch of the same images: replay +
    stream sync (wall), plus the GPU time of a replay (CUDA events)."""
    import torch

    from app.imaging.letterbox import letterbox, to_input

    frames = decoded_frames(images)
    host = to_input([letterbox(f, meta.imgsz)[0] for f in batch_of(frames, batch)])
    dtype = torch.float16 if engine.input_dtype == "float16" else torch.float32
    inp = torch.from_numpy(host).to(engine.device, dtype).contiguous()
    stream = torch.cuda.Stream(device=engine.device)
    stream.wait_stream(torch.cuda.current_stream(engine.device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(3):
            engine.forward(inp)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            engine.forward(inp)
        stream.synchronize()
        gpu_ms = []

        def call():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            graph.replay()
            e1.record(stream)
            stream.synchronize()
            gpu_ms.append(e0.elapsed_time(e1))

        times = measure(call, iters, warmup)
    graph.reset()
    return row("bare", engine.name, engine.precision, "preprocessed", batch, times, mode="bare",
               compiled=getattr(engine, "compiled", None), gpu_ms_p50=round(statistics.median(gpu_ms[-len(times):]), 4),
               timing="engine alone: CUDA graph replay + stream sync, input already letterboxed on the device")


def bench_bare_ort(model_dir: Path, meta, images, batches, iters, warmup) -> list[dict]:
    """The ONNX Runtime session alone on a preprocessed batch of the same images."""
    from app.backends.onnxruntime import OnnxRuntimeBackend
    from app.imaging.letterbox import letterbox, to_input

    frames = decoded_frames(images)
    ort = OnnxRuntimeBackend(model_dir / "model.onnx", precision="fp32")
    rows = []
    try:
        for b in batches:
            batch = to_input([letterbox(f, meta.imgsz)[0] for f in batch_of(frames, b)])
            times = measure(lambda batch=batch: ort.infer(batch), iters, warmup)
            rows.append(row("bare", "onnxruntime", "fp32", "preprocessed", b, times, mode="bare",
                            timing="InferenceSession.run alone on a letterboxed float32 batch"))
    finally:
        ort.close()
    return rows


def add_overheads(rows: list[dict]) -> None:
    """Annotate yolopipe serial frames rows with their overhead over the bare row of the same
    backend, precision and batch (issue #2's goal for ONNX Runtime: ≤ 10 %)."""
    bare = {(r["backend"], r["precision"], r["batch"]): r for r in rows if r.get("mode") == "bare"}
    for r in rows:
        if r["system"] != "yolopipe" or r.get("mode") != "serial" or r["input"] != "frames":
            continue
        b = bare.get((r["backend"], r["precision"], r["batch"]))
        if b is not None:
            r["overhead_vs_bare_pct"] = overhead_pct(r["p50_ms"], b["p50_ms"])


def open_pipeline_detector(backend: str, precision: str, model_dir: Path, meta, max_batch: int, compile_: bool,
                           lanes: int = 1, host_threads: int | None = None):
    from app.pipeline.detector import Detector

    if backend == "onnxruntime":
        from app.backends.onnxruntime import OnnxRuntimeBackend
        from app.pipeline.cpu import CpuPipeline

        host = OnnxRuntimeBackend(model_dir / "model.onnx", precision="fp32")
        return Detector(CpuPipeline(host, meta, max_batch=max_batch))
    from app.gpu.pipeline import GpuPipeline

    if backend == "torch-cuda":
        from app.backends.torch_cuda import TorchCudaEngine

        engine = TorchCudaEngine(model_dir, meta, precision=precision, max_batch=max_batch, compile=compile_)
    else:
        from app.artifacts.engines import find_engine
        from app.backends.tensorrt import TensorRTEngine

        engine = TensorRTEngine(find_engine(model_dir, precision), meta)
        max_batch = min(max_batch, engine.max_batch)
    return Detector(GpuPipeline(engine, meta, max_batch=max_batch, lanes=lanes, host_threads=host_threads))


def warm_buckets(pipeline, batches: list[int], log) -> list[dict]:
    """Capture every lane's graph of each needed bucket now, timing each bucket: the first
    lane's warm-up of a new shape includes torch.compile's compilation of that shape."""
    records = []
    for bucket in sorted({pipeline.bucket_for(b) for b in batches}):
        graphs_before = _dynamo_graphs()
        t0 = time.perf_counter()
        pipeline.warmup([bucket])
        seconds = time.perf_counter() - t0
        rec = {"backend": pipeline.backend, "precision": pipeline.precision, "bucket": bucket,
               "lanes": getattr(pipeline, "num_lanes", 1), "warmup_s": round(seconds, 2),
               "compiled": getattr(pipeline.engine, "compiled", None)}
        after = _dynamo_graphs()
        if graphs_before is not None and after is not None:
            rec["dynamo_graphs_compiled"] = after - graphs_before
        records.append(rec)
        log(f"  bucket {bucket}: captured on {rec['lanes']} lane(s) in {seconds:.1f} s"
            + (f", {rec['dynamo_graphs_compiled']} graph(s) compiled" if "dynamo_graphs_compiled" in rec else ""))
    return records


def _dynamo_graphs() -> int | None:
    """Graphs torch.compile has compiled in this process so far (None if not available)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - reporting only
        return None


def tensorrt_precisions(model_dir: Path) -> list[str]:
    try:
        from app.artifacts.engines import find_engine

        return [p for p in ("int8", "fp16", "fp32") if find_engine(model_dir, p) is not None]
    except Exception:  # noqa: BLE001 - tensorrt or its engines absent: no TensorRT rows
        return []


# -------------------------------------------------------------------------------- NMS
def bench_nms(model_dir: Path, meta, images, gpu: bool, iters: int, warmup: int) -> list[dict]:
    """NMS alone on real head outputs (the sample model on the images), batch 1 and 16."""
    import cv2

    from app.boxes import nms_numpy
    from app.imaging.letterbox import letterbox, to_input
    from app.types import DetectParams

    frames = [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for _, d in images]
    batch = to_input([letterbox(f, meta.imgsz)[0] for f in batch_of(frames, max(NMS_BATCHES))])
    from app.backends.onnxruntime import OnnxRuntimeBackend

    ort = OnnxRuntimeBackend(model_dir / "model.onnx")
    head = ort.infer(batch)  # [16, 4 + nc, A] float32
    ort.close()
    rows = []
    for b in NMS_BATCHES:
        for conf in NMS_CONFS:
            params = DetectParams(conf=conf, iou=0.7)
            n_cand = int((head[:b, 4:].max(1) > conf).sum())
            times = measure(lambda b=b, params=params: [nms_numpy(h, params) for h in head[:b]], iters, warmup)
            rows.append(row("yolopipe", "numpy", "fp32", "nms", b, times, conf=conf, candidates=n_cand))
            rows.append(_ultralytics_nms_row(head[:b], conf, gpu, iters, warmup, n_cand))
            if gpu:
                rows.append(_gpu_nms_row(head[:b], meta, conf, iters, warmup, n_cand))
    return rows


def _ultralytics_nms_row(head: np.ndarray, conf: float, gpu: bool, iters: int, warmup: int, n_cand: int) -> dict:
    import torch
    from ultralytics.utils.nms import non_max_suppression

    pred = torch.from_numpy(head).to("cuda" if gpu else "cpu")

    def call():
        non_max_suppression(pred, conf_thres=conf, iou_thres=0.7, max_det=300)
        if gpu:
            torch.cuda.synchronize()

    times = measure(call, iters, warmup)
    return row("ultralytics", "torch" if gpu else "torch-cpu", "fp32", "nms", head.shape[0], times, conf=conf,
               candidates=n_cand)


def _gpu_nms_row(head: np.ndarray, meta, conf: float, iters: int, warmup: int, n_cand: int) -> dict:
    """GpuNms on a device head: GPU time of one graph replay (CUDA events), plus eager launches."""
    import torch
    from numba import cuda

    from app.gpu.nms import GpuNms

    b = head.shape[0]
    dev_head = torch.from_numpy(head).cuda()
    stream = torch.cuda.Stream()
    nb_stream = cuda.external_stream(stream.cuda_stream)
    nms = GpuNms(b, meta.num_classes, meta.num_anchors)
    nms.set_params(conf=conf, iou=0.7, stream=nb_stream)
    with torch.cuda.stream(stream):
        for _ in range(2):
            nms.run(dev_head, b, nb_stream)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            nms.run(dev_head, b, nb_stream)
        gpu_ms, eager_ms = [], []
        for i in range(warmup + iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            graph.replay()
            e1.record(stream)
            stream.synchronize()
            t0 = time.perf_counter()
            nms.run(dev_head, b, nb_stream)
            stream.synchronize()
            if i >= warmup:
                gpu_ms.append(e0.elapsed_time(e1))
                eager_ms.append((time.perf_counter() - t0) * 1e3)
    graph.reset()
    nms.free()
    return row("yolopipe", "numba-cuda", "fp32", "nms", b, gpu_ms, conf=conf, candidates=n_cand,
               timing="gpu time of one graph replay (CUDA events)",
               eager_launch_p50_ms=round(statistics.median(eager_ms), 4))

# ---------------------------------------------------------------------------------- main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=Path, default=None, help="folder of JPEGs (default: Ultralytics assets + generated)")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/<date>-<gpu|cpu>.json)")
    p.add_argument("--weights", default="sample")
    p.add_argument("--engines-dir", type=Path, default=Path("engines"))
    p.add_argument("--batches", default=None, help="serial rows: comma list (default 1,8,32,128 on a GPU, 1,8 on a CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per serial row (default 50; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="few iterations: proves the benchmark runs")
    p.add_argument("--compile", choices=("none", "fp16", "all"), default="fp16",
                   help="torch.compile the torch-cuda engine for these precisions (~20 s per bucket shape, "
                        "once per run; cached under engines/<model>/torch-cache)")
    p.add_argument("--lanes", type=int, default=2, help="pipeline lanes of the throughput rows (default 2)")
    p.add_argument("--threads", type=int, default=0, help="host threads driving the lanes (default: = lanes)")
    p.add_argument("--host-threads", type=int, default=0, help="pipeline host pool: CPU decode, parallel pack (default: the pipeline's)")
    p.add_argument("--pipelined-batches", default="32,64,128", help="batches of the throughput rows (GPU only)")
    p.add_argument("--pipelined-images", type=int, default=None, help="images per throughput row (default 2048; 256 with --quick)")
    p.add_argument("--decoders", default="gpu,cpu", help="JPEG decoders of the throughput rows: gpu (nvJPEG), cpu (OpenCV threads)")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="wall-clock budget: parts that would start later are skipped (listed in failures)")
    p.add_argument("--row-max-s", type=float, default=4.0, help="time cap of one serial row (at least 3 timed calls)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: "
                   "ultralytics,onnxruntime,torch-cuda,tensorrt,nms,pipelined,bare,fp32")
    p.add_argument("--cpu", action="store_true", help="pretend there is no GPU")
    return p.parse_args(argv)


def default_out(gpu: bool) -> Path:
    tag = "cpu"
    if gpu:
        import torch

        tag = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "-").lower()
    return Path(__file__).resolve().parent / "results" / f"{dt.date.today().isoformat()}-{tag}.json"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    global BUDGET
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from app.builder.export import export_onnx

    args = parse_args(argv)
    BUDGET = Budget(args.budget_s, args.row_max_s)
    console = Console(stderr=True, width=max(120, Console().width))

    def log(msg: str) -> None:
        console.log(f"[{BUDGET.elapsed():6.1f} s] {msg}")

    gpu = has_gpu() and not args.cpu
    iters = args.iters or (3 if args.quick else 50)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    batches = _ints(args.batches) if args.batches else list(GPU_BATCHES if gpu else CPU_BATCHES)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    pipelined_batches = _ints(args.pipelined_batches) if gpu and "pipelined" not in skip else []
    pipelined_images = args.pipelined_images or (256 if args.quick else 2048)
    threads = args.threads or args.lanes
    decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    out_path = args.out or default_out(gpu)

    exported = export_onnx(args.weights, engines_dir=args.engines_dir)
    model_dir, meta = exported.onnx_path.parent, exported.meta
    images = load_images(args.images)
    rows: list[dict] = []
    failures: list[dict] = []
    setup: list[dict] = []

    def attempt(what: dict, fn: Callable[[], object]) -> object:
        """Run one row or part; a failure or a spent budget is recorded, never fatal."""
        if BUDGET.left() <= 0:
            failures.append({**what, "error": f"skipped: past --budget-s {args.budget_s:g}"})
            log(f"skipped (budget): {what}")
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded; the rest of the run goes on
            failures.append({**what, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            log(f"FAILED {what}: {type(exc).__name__}: {exc}")
            return None

    def show(r: dict) -> None:
        extra = "".join(f" {k}={r[k]}" for k in ("mode", "decode", "lanes", "threads", "host_dispatch_us_p50",
                                                  "launch", "gpu_ms_p50", "overhead_vs_bare_pct", "errors") if k in r)
        log(f"  {r['system']} {r['backend']} {r['precision']} {r['input']} b{r['batch']}: p50 {r['p50_ms']:.3f} ms "
            f"p99 {r['p99_ms']:.3f} ms {r['img_per_s']} img/s{extra}")

    def add(new_rows) -> None:
        for r in new_rows or []:
            rows.append(r)
            show(r)

    # ------------------------------------------------------------------- the parts
    def gpu_config(backend: str, precision: str, pipelined: bool) -> None:
        compile_ = args.compile == "all" or (args.compile == "fp16" and precision == "fp16")
        lanes = args.lanes if pipelined and pipelined_batches else 1
        max_b = max(batches + (pipelined_batches if lanes > 1 or pipelined else []))
        detector = open_pipeline_detector(backend, precision, model_dir, meta, max_b, compile_, lanes=lanes,
                                          host_threads=args.host_threads or None)
        with detector:
            pipeline = detector.pipeline
            log(f"{backend} {precision}: {pipeline.num_lanes} lane(s), compile={getattr(pipeline.engine, 'compiled', None)}, "
                f"dispatch={'driver' if pipeline.raw_launch_error is None else 'torch (' + pipeline.raw_launch_error + ')'}")
            these = [b for b in batches if b <= pipeline.max_batch]
            pbatches = [b for b in pipelined_batches if b <= pipeline.max_batch] if pipelined else []
            setup.extend(warm_buckets(pipeline, these + pbatches, log))
            base = {"backend": backend, "precision": precision,
                    "compiled": getattr(pipeline.engine, "compiled", None)}
            for b in these:
                got = attempt({**base, "batch": b, "mode": "serial"},
                              lambda b=b: bench_detector(detector, (backend, precision), images, [b], iters, warmup,
                                                         lambda: None, gpu=True))
                add([{**r, "compiled": base["compiled"]} for r in got or []])
            if pbatches:
                frames = decoded_frames(images)
                datas = [d for _, d in images]
                inputs = [("frames", frames, None)] + [("jpeg", datas, d) for d in decoders]
                for input_, items, decode in inputs:
                    if decode is not None:
                        pipeline.jpeg_decode = decode
                    for b in pbatches:
                        r = attempt({**base, "batch": b, "mode": "pipelined", "input": input_, "decode": decode},
                                    lambda items=items, input_=input_, b=b, decode=decode: bench_pipelined(
                                        detector, (backend, precision), items, input_, b, pipelined_images, threads,
                                        decode))
                        add([{**r, "compiled": base["compiled"]}] if r else [])
                pipeline.jpeg_decode = "gpu"
            if backend == "torch-cuda" and "bare" not in skip:
                best = best_batch(rows)
                for b in sorted({1, best}):
                    r = attempt({**base, "batch": b, "mode": "bare"},
                                lambda b=b: bench_bare_torch(pipeline.engine, meta, images, b, iters, warmup))
                    add([r] if r else [])

    def onnxruntime_part() -> None:
        these = cpu_or_gpu_batches(("onnxruntime", "fp32"), batches, gpu)
        detector = open_pipeline_detector("onnxruntime", "fp32", model_dir, meta, max(these), False)
        with detector:
            for b in these:
                got = attempt({"backend": "onnxruntime", "precision": "fp32", "batch": b, "mode": "serial"},
                              lambda b=b: bench_detector(detector, ("onnxruntime", "fp32"), images, [b], iters, warmup,
                                                         lambda: None, gpu=False))
                add(got)
        if "bare" not in skip:
            add(attempt({"backend": "onnxruntime", "precision": "fp32", "mode": "bare"},
                        lambda: bench_bare_ort(model_dir, meta, images, these, iters, warmup)))

    def ultralytics_part() -> None:
        precisions = ["fp16", "fp32"] if gpu else ["fp32"]
        add(bench_ultralytics(model_dir / "weights.pt", images, batches, precisions, 0 if gpu else "cpu",
                              iters, warmup, lambda: None))

    def nms_part() -> None:
        add(bench_nms(model_dir, meta, images, gpu, iters, warmup))

    # (name, seconds that must be left to start it, what it runs): most important first.
    parts: list[tuple[str, float, Callable[[], None]]] = []
    if gpu and "torch-cuda" not in skip:
        parts.append(("torch-cuda fp16", 0.0, lambda: gpu_config("torch-cuda", "fp16", pipelined=True)))
    if "onnxruntime" not in skip:
        parts.append(("onnxruntime fp32", 15.0, onnxruntime_part))
    if gpu and "tensorrt" not in skip:
        for p in tensorrt_precisions(model_dir):
            parts.append((f"tensorrt {p}", 30.0, lambda p=p: gpu_config("tensorrt", p, pipelined=True)))
    if "ultralytics" not in skip:
        parts.append(("ultralytics predict", 30.0, ultralytics_part))
    if gpu and "torch-cuda" not in skip and "fp32" not in skip:
        parts.append(("torch-cuda fp32", 40.0, lambda: gpu_config("torch-cuda", "fp32", pipelined=False)))
    if "nms" not in skip:
        parts.append(("NMS alone", 8.0, nms_part))

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("benchmark", total=len(parts))
        for name, needed, fn in parts:
            progress.update(task, description=name)
            if BUDGET.left() < needed:
                failures.append({"part": name, "error": f"skipped: {BUDGET.left():.0f} s of --budget-s left, needs ~{needed:g}"})
                log(f"skipped {name}: budget")
            else:
                log(f"{name} ...")
                attempt({"part": name}, fn)
            progress.advance(task)
    add_overheads(rows)

    result = {
        "machine": machine_info(gpu),
        "versions": versions(),
        "config": {"images": [n for n, _ in images], "iters": iters, "warmup": warmup, "batches": batches,
                   "pipelined_batches": pipelined_batches, "pipelined_images": pipelined_images,
                   "lanes": args.lanes, "threads": threads, "decoders": decoders, "budget_s": args.budget_s,
                   "row_max_s": args.row_max_s, "compile": args.compile, "model": meta.name, "imgsz": meta.imgsz,
                   "date": dt.datetime.now().isoformat(), "elapsed_s": round(BUDGET.elapsed(), 1)},
        "setup": setup,
        "rows": rows,
        "failures": failures,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    _print_table(console, rows)
    if failures:
        console.print(f"{len(failures)} failure(s)/skip(s): see 'failures' in the JSON")
    console.print(f"wrote {out_path} in {BUDGET.elapsed():.0f} s")
    return 0


def cpu_or_gpu_batches(config: tuple[str, str], batches: list[int], gpu: bool) -> list[int]:
    """The CPU backend runs the CPU batch sizes only (batch 128 on ONNX Runtime is minutes)."""
    if config[0] == "onnxruntime" and gpu:
        return [b for b in batches if b <= max(CPU_BATCHES)] or [min(batches)]
    return batches


def _print_table(console, rows: list[dict]) -> None:
    from rich.table import Table

    table = Table("system", "backend", "prec", "input", "mode", "batch", "p50 ms", "p99 ms", "img/s", "dispatch µs",
                  "over bare %")
    for r in rows:
        mode = r.get("mode", "")
        if mode == "pipelined":
            mode = f"pipe {r.get('lanes')}L/{r.get('threads')}T"
        input_ = r["input"] + (f" c={r['conf']}" if "conf" in r else "") + (f" {r['decode']}" if r.get("decode") else "")
        table.add_row(r["system"], r["backend"], r["precision"], input_, mode, str(r["batch"]), f"{r['p50_ms']:.3f}",
                      f"{r['p99_ms']:.3f}", str(r["img_per_s"]), str(r.get("host_dispatch_us_p50", "")),
                      str(r.get("overhead_vs_bare_pct", "")))
    console.print(table)


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        sys.exit(main())
