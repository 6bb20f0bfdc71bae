"""yolopipe's rows: serial latency per batch call, throughput with batches in flight (and the
stage timeline of that run), the bare engine, and the per-bucket warm-up times.

* ``serial``: one ``Detector.run`` at a time, images in → boxes in original pixels on the
  host, with the pipeline's stage times (``host_*_ms_p50``: decode, preprocess, infer,
  postprocess, the same on every backend); on the GPU also the launch's host costs from the
  runs' facts (``host_upload_us_p50``, ``host_dispatch_us_p50``, ``host_launch_us_p50``) and the
  stage split of the profiling path (``gpu_*_ms_p50``).
* ``pipelined``: ``Detector.run_batches`` keeps ``RunShape.in_flight`` batches in flight until
  ``images`` images are done; ``img_per_s`` = images / wall time; p50/p99 per batch.
* ``bare``: the engine alone on an already letterboxed batch (``Detector.diagnose(bare=...)``):
  in a CUDA graph of its own (torch-cuda), or ``InferenceSession.run`` alone (onnxruntime).

Everything beyond answers is asked of the Detector through ``Detector.diagnose``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import numpy as np

from app.benchmark.timing import Budget, batch_of, median_of, row

LAUNCH_KEYS = ("upload_us", "dispatch_us", "launch_us")  # RunFacts: the launch's host costs (GPU)


def decoded_frames(images) -> list[np.ndarray]:
    import cv2

    return [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for _, d in images]


def serial_rows(detector, images, batch: int, budget: Budget, iters: int, warmup: int, gpu: bool) -> list[dict]:
    """Frames and JPEG bytes through the detector, one call at a time."""
    params = detector.params()
    rows = []
    for input_, items in (("frames", batch_of(decoded_frames(images), batch)),
                          ("jpeg", batch_of([d for _, d in images], batch))):
        answers: list = []

        def call(items=items, answers=answers):
            answers.append(detector.run(items, params))

        times = budget.measure(call, iters, warmup)
        extra: dict = {"mode": "serial"}
        if gpu and input_ == "jpeg":
            extra["decode"] = detector.diagnose().decoder
        timed = answers[-len(times):]
        stages = [a.timings.as_dict() for a in timed]
        for key in stages[0]:
            extra[f"host_{key}_p50"] = median_of(stages, key)
        if gpu:
            launches = [asdict(a.runs[-1]) for a in timed if a.runs]  # each batch is one run
            for key in LAUNCH_KEYS:
                extra[f"host_{key}_p50"] = median_of(launches, key)
            extra["launch"] = launches[-1]["launch"] if launches else ""
            prof = [detector.diagnose(profile=items, params=params).profiled.device_ms
                    for _ in range(max(3, min(iters // 2, len(times))))]
            for key in prof[0]:
                extra[f"gpu_{key}_ms_p50"] = median_of(prof, key)
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

    timeline = detector.diagnose(timeline=True).timeline  # GPU pipelines only: these rows are GPU rows
    t0 = time.perf_counter()
    try:
        for k, out in enumerate(detector.run_batches(batches(), params)):
            latencies.append((time.perf_counter() - starts[k]) * 1e3)
            errors.extend(str(error) for error in out.errors.values())
    finally:
        wall = time.perf_counter() - t0
        timeline.close()
    done = len(latencies) * batch
    r = row("yolopipe", detector.backend, detector.precision, input_, batch, latencies, mode="pipelined",
            in_flight=in_flight, images=done, wall_s=round(wall, 3))
    r["img_per_s"] = round(done / wall, 1) if wall > 0 and done else None
    if decode is not None:
        r["decode"] = detector.diagnose().decoder
    if errors:
        r["errors"] = len(errors)
        r["first_error"] = errors[0][:300]
    r["timeline_summary"] = timeline.summary()
    r["timeline"] = timeline.records
    return r


def bare_rows(detector, images, batches, budget: Budget, iters: int, warmup: int) -> list[dict]:
    """The engine alone on a letterboxed batch of the same images, per batch size
    (``Detector.diagnose(bare=...)``): on a GPU in a CUDA graph of its own, replay + stream sync
    (wall) and the GPU time of a replay (CUDA events); on the CPU ``InferenceSession.run`` alone."""
    from app.imaging.letterbox import letterbox, to_input

    frames = decoded_frames(images)
    rows = []
    for b in batches:
        batch = to_input([letterbox(f, detector.meta.imgsz)[0] for f in batch_of(frames, b)])
        found = detector.diagnose(bare=batch, measure=lambda call: budget.measure(call, iters, warmup))
        times, extra = found.bare.times_ms, {}
        if found.bare.device_ms:
            extra = {"compiled": found.compiled, "gpu_ms_p50": round(statistics.median(found.bare.device_ms), 4),
                     "timing": "engine alone: CUDA graph replay + stream sync, input already letterboxed on the device"}
        else:
            extra = {"timing": "InferenceSession.run alone on a letterboxed float32 batch"}
        rows.append(row("bare", detector.backend, detector.precision, "preprocessed", b, times, mode="bare", **extra))
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
               "compiled": detector.diagnose().compiled}
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
