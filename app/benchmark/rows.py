"""yolopipe's rows: serial latency per batch call, throughput with batches in flight (and the
stage timeline of that run), the bare engine, and the per-bucket warm-up times.

* ``serial``: one ``Detector.run`` at a time, images in → boxes in original pixels on the
  host; on the GPU also the stage split of the profiling path (``gpu_*_ms_p50``) and the host
  parts (``host_*_p50``: decode, pack, upload and dispatch enqueue, wait).
* ``pipelined``: ``Detector.run_batches`` keeps ``RunShape.in_flight`` batches in flight until
  ``images`` images are done; ``img_per_s`` = images / wall time; p50/p99 per batch.
* ``bare``: the engine alone in a CUDA graph on an already letterboxed batch (torch-cuda), or
  ``InferenceSession.run`` alone (onnxruntime).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from app.benchmark.timing import Budget, batch_of, median_of, row

HOST_KEYS = ("decode_ms", "pack_ms", "upload_us", "dispatch_us", "launch_us", "wait_ms", "unpack_ms", "preprocess_ms", "engine_ms",
             "nms_ms", "raw_launch")
GPU_KEYS = ("gpu_h2d_ms", "gpu_preprocess_ms", "gpu_engine_ms", "gpu_nms_ms", "gpu_d2h_ms", "gpu_total_ms")


def decoded_frames(images) -> list[np.ndarray]:
    import cv2

    return [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for _, d in images]


def serial_rows(detector, images, batch: int, budget: Budget, iters: int, warmup: int, gpu: bool) -> list[dict]:
    """Frames and JPEG bytes through the detector, one call at a time."""
    params = detector.params()
    rows = []
    for input_, items in (("frames", batch_of(decoded_frames(images), batch)),
                          ("jpeg", batch_of([d for _, d in images], batch))):
        timings: list[dict] = []

        def call(items=items, timings=timings):
            timings.append(detector.run(items, params).timings)

        times = budget.measure(call, iters, warmup)
        extra: dict = {"mode": "serial"}
        if gpu and input_ == "jpeg":
            extra["decode"] = detector.decoder_name
        host = timings[-len(times):]
        for key in HOST_KEYS:
            v = median_of(host, key)
            if v is not None:
                extra[f"host_{key}_p50"] = v
        if gpu:
            extra["launch"] = detector.last_launch_path
            prof = [detector.profiled_timings(items, params) for _ in range(max(3, min(iters // 2, len(times))))]
            for key in GPU_KEYS:
                v = median_of(prof, key)
                if v is not None:
                    extra[f"{key}_p50"] = v
        rows.append(row("yolopipe", detector.backend, detector.precision, input_, batch, times, **extra))
    return rows


def pipelined_row(detector, items: list, input_: str, batch: int, n_images: int, decode: str | None) -> dict:
    """Throughput with ``in_flight`` batches in flight; the stage timeline of the run rides along."""
    params = detector.params()
    in_flight = detector.shape.in_flight
    n_batches = max(in_flight, -(-n_images // batch))
    # A few distinct batches (rotated inputs), so consecutive batches are not byte-identical.
    variants = [[items[(k * 7 + i) % len(items)] for i in range(batch)] for k in range(min(4, n_batches))]
    for _ in detector.run_batches(variants[:in_flight], params):  # every BatchSlot's graphs captured
        pass
    latencies: list[float] = []
    errors: list[str] = []
    starts: dict[int, float] = {}

    def batches():
        for k in range(n_batches):
            starts[k] = time.perf_counter()
            yield variants[k % len(variants)]

    timeline = detector.start_timeline()  # GPU pipelines only: these rows are GPU rows
    t0 = time.perf_counter()
    try:
        for k, out in enumerate(detector.run_batches(batches(), params)):
            latencies.append((time.perf_counter() - starts[k]) * 1e3)
            errors.extend(str(error) for error in out.errors.values())
    finally:
        wall = time.perf_counter() - t0
        detector.stop_timeline()
    done = len(latencies) * batch
    r = row("yolopipe", detector.backend, detector.precision, input_, batch, latencies, mode="pipelined",
            in_flight=in_flight, images=done, wall_s=round(wall, 3))
    r["img_per_s"] = round(done / wall, 1) if wall > 0 and done else None
    if decode is not None:
        r["decode"] = detector.decoder_name
    if errors:
        r["errors"] = len(errors)
        r["first_error"] = errors[0][:300]
    r["timeline_summary"] = timeline.summary()
    r["timeline"] = timeline.records
    return r


def bare_torch_row(engine, meta, images, batch: int, budget: Budget, iters: int, warmup: int) -> dict:
    """The engine alone in a CUDA graph on a letterboxed batch of the same images: replay +
    stream sync (wall), plus the GPU time of a replay (CUDA events)."""
    import torch

    from app.imaging.letterbox import letterbox, to_input

    host = to_input([letterbox(f, meta.imgsz)[0] for f in batch_of(decoded_frames(images), batch)])
    dtype = torch.float16 if engine.input_dtype == "float16" else torch.float32
    inp = torch.from_numpy(host).to(engine.device, dtype).contiguous()
    stream = torch.cuda.Stream(device=engine.device)
    stream.wait_stream(torch.cuda.current_stream(engine.device))
    graph = torch.cuda.CUDAGraph()
    gpu_ms: list[float] = []
    with torch.cuda.stream(stream):
        for _ in range(3):
            engine.forward(inp)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            engine.forward(inp)
        stream.synchronize()

        def call():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            graph.replay()
            e1.record(stream)
            stream.synchronize()
            gpu_ms.append(e0.elapsed_time(e1))

        times = budget.measure(call, iters, warmup)
    graph.reset()
    return row("bare", engine.name, engine.precision, "preprocessed", batch, times, mode="bare",
               compiled=engine.compiled, gpu_ms_p50=round(statistics.median(gpu_ms[-len(times):]), 4),
               timing="engine alone: CUDA graph replay + stream sync, input already letterboxed on the device")


def bare_ort_rows(model_dir, meta, images, batches, budget: Budget, iters: int, warmup: int) -> list[dict]:
    """The ONNX Runtime session alone on a preprocessed batch of the same images."""
    from app.backends.onnxruntime import OnnxRuntimeBackend
    from app.imaging.letterbox import letterbox, to_input

    frames = decoded_frames(images)
    ort = OnnxRuntimeBackend(model_dir / "model.onnx", precision="fp32")
    rows = []
    try:
        for b in batches:
            batch = to_input([letterbox(f, meta.imgsz)[0] for f in batch_of(frames, b)])
            times = budget.measure(lambda batch=batch: ort.infer(batch), iters, warmup)
            rows.append(row("bare", "onnxruntime", "fp32", "preprocessed", b, times, mode="bare",
                            timing="InferenceSession.run alone on a letterboxed float32 batch"))
    finally:
        ort.close()
    return rows


def warm_buckets(detector, batches: list[int], log) -> list[dict]:
    """Capture every slot's graph of each needed bucket now, timing each bucket: the first
    capture of a new shape includes torch.compile's compilation of that shape."""
    records = []
    for bucket in sorted({min(b for b in detector.buckets if b >= n) for n in batches}):
        graphs_before = _dynamo_graphs()
        t0 = time.perf_counter()
        detector.warmup([bucket])
        seconds = time.perf_counter() - t0
        rec = {"backend": detector.backend, "precision": detector.precision, "bucket": bucket,
               "slots": detector.shape.in_flight, "warmup_s": round(seconds, 2),
               "compiled": detector.engine.compiled}
        after = _dynamo_graphs()
        if graphs_before is not None and after is not None:
            rec["dynamo_graphs_compiled"] = after - graphs_before
        records.append(rec)
        log(f"  bucket {bucket}: captured on {rec['slots']} slot(s) in {seconds:.1f} s")
    return records


def _dynamo_graphs() -> int | None:
    """Graphs torch.compile has compiled in this process so far (None if not available)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - reporting only
        return None
