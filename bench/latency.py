"""yolopipe latency/throughput benchmark: Ultralytics ``predict`` vs yolopipe, in one run.

    python bench/latency.py [--quick] [--images DIR] [--out FILE.json] [--batches 1,8] ...

Rows (one per measurement, see bench/README.md): Ultralytics FP16/FP32 (GPU when present,
else CPU FP32); yolopipe per available backend (onnxruntime; torch-cuda fp16/fp32 on a GPU;
TensorRT when installed and an engine is built); input from decoded frames and from JPEG
bytes; p50/p99 per batch call; on the GPU the CUDA-event split per stage (profiling path)
and the host dispatch per batch; NMS alone at batch 1 and 16 with conf 0.25 and 0.001.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

if __package__ in (None, ""):  # `python bench/latency.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

os.environ.setdefault("YOLO_OFFLINE", "1")

GPU_BATCHES = (1, 8, 32, 128)
CPU_BATCHES = (1, 8)
NMS_BATCHES = (1, 16)
NMS_CONFS = (0.25, 0.001)
VERSION_PACKAGES = (
    "yolopipe", "torch", "torchvision", "ultralytics", "onnxruntime", "numba", "numba-cuda", "numpy",
    "opencv-python-headless", "opencv-python", "tensorrt", "tensorrt-cu12", "tensorrt-cu13",
    "cupy-cuda12x", "cupy-cuda13x",
)


# ---------------------------------------------------------------------------- the machine
def has_gpu() -> bool:
    from app.gpu.probe import cuda_device_count

    return cuda_device_count() > 0


def machine_info(gpu: bool) -> dict:
    info: dict = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    if gpu:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        info["driver"] = _nvidia_smi("driver_version")
        info["gpu_memory_mib"] = _nvidia_smi("memory.total")
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=False,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict:
    out = {}
    for pkg in VERSION_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


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
def measure(fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
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


# ------------------------------------------------------------------------ Ultralytics
def bench_ultralytics(weights: Path, images, batches, precisions, device, iters, warmup, progress, task) -> list[dict]:
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
                progress.advance(task)
    return rows


# ------------------------------------------------------------------------------ yolopipe
def bench_detector(detector, label: tuple[str, str], images, batches, iters, warmup, progress, task, gpu: bool) -> list[dict]:
    """Frames and JPEG bytes through the one detector API; on the GPU also the stage split."""
    import cv2

    backend, precision = label
    frames = [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for _, d in images]
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
            extra: dict = {}
            host = timings[-iters:]
            for key in ("dispatch_us", "decode_ms", "pack_ms", "wait_ms", "preprocess_ms", "engine_ms", "nms_ms"):
                v = median_of(host, key)
                if v is not None:
                    extra[f"host_{key}_p50"] = v
            if gpu and hasattr(pipeline, "run"):
                # The stage split: the profiling path (per-stage graphs with CUDA events between).
                prepared = [detector.prepare(x) for x in items]
                prof = []
                for _ in range(max(3, iters // 2)):
                    pipeline.run(prepared, params, profile=True)
                    prof.append(dict(pipeline.last_timings))
                for key in ("gpu_decode_ms", "gpu_h2d_ms", "gpu_preprocess_ms", "gpu_engine_ms", "gpu_nms_ms",
                            "gpu_d2h_ms", "gpu_total_ms"):
                    v = median_of(prof, key)
                    if v is not None:
                        extra[f"{key}_p50"] = v
            rows.append(row("yolopipe", backend, precision, input_, b, times, **extra))
            progress.advance(task)
    return rows


def open_pipeline_detector(backend: str, precision: str, model_dir: Path, meta, max_batch: int, compile_: bool):
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
        from app.backends.tensorrt import TensorRTEngine, find_engine

        engine = TensorRTEngine(find_engine(model_dir, precision), meta)
        max_batch = min(max_batch, engine.max_batch)
    return Detector(GpuPipeline(engine, meta, max_batch=max_batch))


def tensorrt_precisions(model_dir: Path) -> list[str]:
    try:
        from app.backends.tensorrt import find_engine

        return [p for p in ("int8", "fp16", "fp32") if find_engine(model_dir, p) is not None]
    except Exception:  # noqa: BLE001 - tensorrt or its engines absent: no TensorRT rows
        return []


# -------------------------------------------------------------------------------- NMS
def bench_nms(model_dir: Path, meta, images, gpu: bool, iters: int, warmup: int) -> list[dict]:
    """NMS alone on real head outputs (the sample model on the images), batch 1 and 16."""
    import cv2

    from app.pipeline.postprocess import nms_numpy
    from app.pipeline.preprocess import letterbox, to_input
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
    p.add_argument("--batches", default=None, help="comma list (default 1,8,32,128 on a GPU, 1,8 on a CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per row (default 50; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="few iterations: proves the benchmark runs")
    p.add_argument("--compile", choices=("none", "fp16", "all"), default="fp16",
                   help="torch.compile the torch-cuda engine for these precisions (slow first time; cached)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: ultralytics,onnxruntime,torch-cuda,tensorrt,nms")
    p.add_argument("--cpu", action="store_true", help="pretend there is no GPU")
    return p.parse_args(argv)


def default_out(gpu: bool) -> Path:
    tag = "cpu"
    if gpu:
        import torch

        tag = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "-").lower()
    return Path(__file__).resolve().parent / "results" / f"{dt.date.today().isoformat()}-{tag}.json"


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from app.build.export import export_onnx

    args = parse_args(argv)
    console = Console(stderr=True, width=max(120, Console().width))
    gpu = has_gpu() and not args.cpu
    iters = args.iters or (3 if args.quick else 50)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else list(GPU_BATCHES if gpu else CPU_BATCHES)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    out_path = args.out or default_out(gpu)

    exported = export_onnx(args.weights, engines_dir=args.engines_dir)
    model_dir, meta = exported.onnx_path.parent, exported.meta
    images = load_images(args.images)

    configs: list[tuple[str, str]] = []
    if "onnxruntime" not in skip:
        configs.append(("onnxruntime", "fp32"))
    if gpu and "torch-cuda" not in skip:
        configs += [("torch-cuda", "fp16"), ("torch-cuda", "fp32")]
    if gpu and "tensorrt" not in skip:
        configs += [("tensorrt", p) for p in tensorrt_precisions(model_dir)]
    ul_precisions = ["fp16", "fp32"] if gpu else ["fp32"]

    n_steps = (0 if "ultralytics" in skip else len(ul_precisions) * len(batches) * 2)
    n_steps += sum(len(cpu_or_gpu_batches(c, batches, gpu)) * 2 for c in configs)
    rows: list[dict] = []
    failures: list[dict] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("benchmark", total=n_steps + (0 if "nms" in skip else 1))
        if "ultralytics" not in skip:
            progress.update(task, description="ultralytics predict")
            rows += bench_ultralytics(model_dir / "weights.pt", images, batches, ul_precisions, 0 if gpu else "cpu",
                                      iters, warmup, progress, task)
        for backend, precision in configs:
            progress.update(task, description=f"yolopipe {backend} {precision}")
            these = cpu_or_gpu_batches((backend, precision), batches, gpu)
            try:
                compile_ = args.compile == "all" or (args.compile == "fp16" and precision == "fp16")
                detector = open_pipeline_detector(backend, precision, model_dir, meta, max(these), compile_)
            except Exception as exc:  # noqa: BLE001 - a backend that cannot start is reported, not fatal
                failures.append({"backend": backend, "precision": precision, "error": f"{type(exc).__name__}: {exc}"})
                progress.advance(task, len(these) * 2)
                continue
            with detector:
                extra = {"compiled": getattr(getattr(detector.pipeline, "engine", None), "compiled", None)}
                for r in bench_detector(detector, (backend, precision), images, these, iters, warmup, progress, task,
                                        gpu=backend != "onnxruntime"):
                    rows.append({**r, **{k: v for k, v in extra.items() if v is not None}})
        if "nms" not in skip:
            progress.update(task, description="NMS alone")
            rows += bench_nms(model_dir, meta, images, gpu, iters, warmup)
            progress.advance(task)

    result = {
        "machine": machine_info(gpu),
        "versions": versions(),
        "config": {"images": [n for n, _ in images], "iters": iters, "warmup": warmup, "batches": batches,
                   "compile": args.compile, "model": meta.name, "imgsz": meta.imgsz, "date": dt.datetime.now().isoformat()},
        "rows": rows,
        "failures": failures,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    _print_table(console, rows)
    console.print(f"wrote {out_path}")
    return 0


def cpu_or_gpu_batches(config: tuple[str, str], batches: list[int], gpu: bool) -> list[int]:
    """The CPU backend runs the CPU batch sizes only (batch 128 on ONNX Runtime is minutes)."""
    if config[0] == "onnxruntime" and gpu:
        return [b for b in batches if b <= max(CPU_BATCHES)] or [min(batches)]
    return batches


def _print_table(console, rows: list[dict]) -> None:
    from rich.table import Table

    table = Table("system", "backend", "prec", "input", "batch", "p50 ms", "p99 ms", "img/s", "dispatch µs")
    for r in rows:
        table.add_row(r["system"], r["backend"], r["precision"], r["input"] + (f" c={r['conf']}" if "conf" in r else ""),
                      str(r["batch"]), f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", str(r["img_per_s"]),
                      str(r.get("host_dispatch_us_p50", "")))
    console.print(table)


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        sys.exit(main())
