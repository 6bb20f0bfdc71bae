"""``run_benchmark``: Ultralytics and yolopipe on the same model and images, in one run.

Parts, most important first (a part that would start past ``budget_s`` is skipped and listed
in ``failures``; a part or row that fails is recorded there too, and the run goes on):

1. torch-cuda fp16 (GPU): serial rows per batch (frames, JPEG) with the stage split;
   throughput rows with batches in flight (frames, and JPEG per decoder) with the stage
   timeline; the bare engine; the folder benchmark (yolopipe and Ultralytics on the same
   folder); fidelity of the default GPU decode against Ultralytics on varied JPEGs;
2. the JPEG decoders side by side (GPU);
3. ONNX Runtime fp32 (serial + bare);  4. TensorRT, per engine built;
5. Ultralytics ``predict`` per batch (fp16 and fp32 on a GPU, fp32 on a CPU);
6. torch-cuda fp32 (serial);  7. the NMS alone.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from app.benchmark import report
from app.benchmark.options import BenchOptions
from app.benchmark.timing import Budget
from app.config import ENGINE_PRECISIONS, SERVE_MAX_BATCH


def run_benchmark(options: BenchOptions, console) -> dict:
    """Run the parts ``options`` ask for, write the result JSON to ``options.out`` (default: a
    file in the current directory) and return the result."""
    from app.builder.export import export_onnx
    from app.gpu.probe import cuda_device_count

    gpu = cuda_device_count() > 0 and not options.cpu
    opts = options.resolved(gpu)
    budget = Budget(opts.budget_s, opts.row_max_s)

    def log(msg: str) -> None:
        console.log(f"[{budget.elapsed():6.1f} s] {msg}")

    from app.benchmark.workloads import load_images

    exported = export_onnx(opts.weights, artifacts_dir=opts.artifacts_dir)
    model_dir, meta = exported.model_dir, exported.meta
    images = load_images(opts.images)
    rows: list[dict] = []
    failures: list[dict] = []
    setup: list[dict] = []
    ctx = _Context(opts, budget, gpu, model_dir, meta, images, rows, failures, setup, log)

    parts: list[tuple[str, float, Callable[[], None]]] = []
    if gpu and opts.wants("torch-cuda"):
        parts.append(("torch-cuda fp16", 0.0, lambda: ctx.gpu_config("torch-cuda", "fp16", main=True)))
    if gpu and opts.wants("decoders"):
        parts.append(("JPEG decoders", 20.0, ctx.decoders_part))
    if opts.wants("onnxruntime"):
        parts.append(("onnxruntime fp32", 15.0, ctx.onnxruntime_part))
    if gpu and opts.wants("tensorrt"):
        for p in _tensorrt_precisions(model_dir):
            parts.append((f"tensorrt {p}", 30.0, lambda p=p: ctx.gpu_config("tensorrt", p, main=False)))
    if opts.wants("ultralytics"):
        parts.append(("ultralytics predict", 30.0, ctx.ultralytics_part))
    if gpu and opts.wants("torch-cuda") and opts.wants("fp32"):
        parts.append(("torch-cuda fp32", 40.0, lambda: ctx.gpu_config("torch-cuda", "fp32", main=False)))
    if opts.wants("nms"):
        parts.append(("NMS alone", 8.0, ctx.nms_part))

    for name, needed, fn in parts:
        if budget.left() < needed:
            failures.append({"part": name, "error": f"skipped: {budget.left():.0f} s of the budget left, needs ~{needed:g}"})
            log(f"skipped {name}: budget")
            continue
        log(f"{name} ...")
        ctx.attempt({"part": name}, fn)
    report.add_overheads(rows)
    timeline = report.hoist_timeline(rows)

    from app.benchmark.machine import code_revision, machine_info, versions

    result = {
        "machine": machine_info(gpu),
        "versions": versions(),
        "code": code_revision(),
        "config": {"images": [n for n, _ in images], "iters": opts.iters, "warmup": opts.warmup,
                   "batches": list(opts.batches), "pipelined_batches": list(opts.pipelined_batches),
                   "pipelined_images": opts.pipelined_images, "decoders": list(opts.decoders),
                   "folder_images": opts.folder_images, "folder_batch": opts.folder_batch, "budget_s": opts.budget_s,
                   "row_max_s": opts.row_max_s, "compile": opts.compile, "model": meta.name, "imgsz": meta.imgsz,
                   "date": dt.datetime.now().isoformat(), "elapsed_s": round(budget.elapsed(), 1)},
        "setup": setup,
        "rows": rows,
        "timeline": timeline,
        "failures": failures,
    }
    report.write(result, opts.out)
    report.print_table(console, rows)
    if failures:
        console.print(f"{len(failures)} failure(s)/skip(s): see 'failures' in the JSON")
    console.print(f"wrote {opts.out} in {budget.elapsed():.0f} s")
    return result


class _Context:
    """The run's state, shared by the parts."""

    def __init__(self, opts, budget, gpu, model_dir, meta, images, rows, failures, setup, log) -> None:
        self.opts, self.budget, self.gpu = opts, budget, gpu
        self.model_dir, self.meta, self.images = model_dir, meta, images
        self.rows, self.failures, self.setup, self.log = rows, failures, setup, log

    def attempt(self, what: dict, fn: Callable[[], object]) -> object:
        """Run one row or part; a failure or a spent budget is recorded, never fatal."""
        if self.budget.left() <= 0:
            self.failures.append({**what, "error": f"skipped: past the budget of {self.opts.budget_s:g} s"})
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded; the rest of the run goes on
            self.failures.append({**what, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            self.log(f"FAILED {what}: {type(exc).__name__}: {exc}")
            return None

    def add(self, new_rows) -> None:
        for r in new_rows or []:
            self.rows.append(r)
            self.log(report.describe(r))

    # ------------------------------------------------------------------------- parts
    def gpu_config(self, backend: str, precision: str, *, main: bool) -> None:
        from app.benchmark import rows as R
        from app.contracts import RunShape
        from app.runtime import OpenOptions, ensure_engine, open_model_dir

        o = self.opts
        compile_ = o.compile == "all" or (o.compile == "fp16" and precision == "fp16")
        pbatches = list(o.pipelined_batches) if main and o.wants("pipelined") else []
        folder = main and o.wants("folder") and o.folder_images > 0
        max_b = max([*o.batches, *pbatches, *([o.folder_batch] if folder else [])])
        options = OpenOptions(o.weights, backend=backend, precision=precision, artifacts_dir=o.artifacts_dir,
                              compile=compile_, shape=RunShape(max_batch=max_b))
        ensure_engine(self.model_dir, options)  # the torch-cuda engine, built before anything is timed
        detector = open_model_dir(self.model_dir, options)
        with detector:
            shape, found = detector.shape, detector.diagnose()
            launch_error = found.launch_error
            self.log(f"{backend} {precision}: {shape.in_flight} batches in flight, max batch {shape.max_batch}, "
                     f"compiled={found.compiled}, decoder {found.decoder}, "
                     f"dispatch={'driver' if launch_error is None else 'torch: ' + launch_error}")
            these = [b for b in o.batches if b <= shape.max_batch]
            pbatches = [b for b in pbatches if b <= shape.max_batch]
            self.setup.extend(R.warm_buckets(detector, these + pbatches, self.log))
            base = {"backend": backend, "precision": precision}
            for b in these:
                self.add(self.attempt({**base, "batch": b, "mode": "serial"}, lambda b=b: R.serial_rows(
                    detector, self.images, b, self.budget, o.iters, o.warmup, gpu=True)))
            if pbatches:
                frames = R.decoded_frames(self.images)
                datas = [d for _, d in self.images]
                for input_, items, decode in [("frames", frames, None)] + [("jpeg", datas, d) for d in o.decoders]:
                    # JPEG decoded by this decoder: a detector of that shape on the same pipeline
                    decoding = detector if decode is None else detector.reshaped(decode=decode)
                    for b in pbatches:
                        r = self.attempt({**base, "batch": b, "mode": "pipelined", "input": input_, "decode": decode},
                                         lambda items=items, input_=input_, b=b, decode=decode, decoding=decoding:
                                         R.pipelined_row(decoding, items, input_, b, o.pipelined_images, decode))
                        self.add([r] if r else [])
            if backend == "torch-cuda" and o.wants("bare"):
                best = _best_batch(self.rows, backend, precision)
                for b in sorted({1, best}):
                    self.add(self.attempt({**base, "batch": b, "mode": "bare"}, lambda b=b: R.bare_rows(
                        detector, self.images, [b], self.budget, o.iters, o.warmup)))
            if folder:
                from app.benchmark.folder import folder_rows

                # the folder's batches are its detector's: the run's, at --folder-batch
                in_folder = detector.reshaped(max_batch=min(o.folder_batch, shape.max_batch))
                self.add(self.attempt({**base, "mode": "folder"}, lambda: folder_rows(
                    in_folder, self.model_dir / "weights.pt", self.images, o.folder_images, True,
                    o.wants("ultralytics"), max(20.0, min(90.0, self.budget.left() / 3)), self.log)))
            if main and o.wants("fidelity"):
                self.add(self.attempt({**base, "mode": "fidelity"}, lambda: _fidelity_rows(detector, self.model_dir)))

    def decoders_part(self) -> None:
        from app.benchmark.decoders import decoder_rows

        self.add(decoder_rows(self.images, self.log))

    def onnxruntime_part(self) -> None:
        from app.benchmark import rows as R
        from app.contracts import RunShape
        from app.runtime import OpenOptions, open_model_dir

        o = self.opts
        these = [b for b in o.batches if b <= 8] or [min(o.batches)]  # ONNX Runtime at batch 128 is minutes
        detector = open_model_dir(self.model_dir, OpenOptions(o.weights, backend="onnxruntime", precision="fp32",
                                                              artifacts_dir=o.artifacts_dir,
                                                              shape=RunShape(max_batch=max(these))))
        with detector:
            for b in these:
                self.add(self.attempt({"backend": "onnxruntime", "batch": b, "mode": "serial"}, lambda b=b: R.serial_rows(
                    detector, self.images, b, self.budget, o.iters, o.warmup, gpu=False)))
            if o.wants("bare"):
                self.add(self.attempt({"backend": "onnxruntime", "mode": "bare"}, lambda: R.bare_rows(
                    detector, self.images, these, self.budget, o.iters, o.warmup)))

    def ultralytics_part(self) -> None:
        from app.benchmark.baseline import ultralytics_rows

        o = self.opts
        self.add(ultralytics_rows(self.model_dir / "weights.pt", self.images, o.batches,
                                  ["fp16", "fp32"] if self.gpu else ["fp32"], 0 if self.gpu else "cpu", self.budget,
                                  o.iters, o.warmup))

    def nms_part(self) -> None:
        from app.benchmark.nms import nms_rows

        o = self.opts
        self.add(nms_rows(self.model_dir, self.meta, self.images, self.gpu, self.budget, o.iters, o.warmup))


def _best_batch(rows: list[dict], backend: str, precision: str, default: int = SERVE_MAX_BATCH) -> int:
    cands = [r for r in rows if r.get("mode") == "pipelined" and r["input"] == "frames" and r.get("img_per_s")
             and r["backend"] == backend and r["precision"] == precision]
    return max(cands, key=lambda r: r["img_per_s"])["batch"] if cands else default


def _fidelity_rows(detector, model_dir) -> list[dict]:
    """The default GPU decode (and decode="opencv") against Ultralytics at the same precision and
    letterbox (rect: its predict defaults; square: rect=False), on the generated varied JPEGs: F1
    and the largest score difference of a matched box."""
    from ultralytics import YOLO

    from app.benchmark.fidelity import agreement
    from app.benchmark.workloads import varied_jpegs
    from app.imaging.decode import decode_image

    model = YOLO(str(model_dir / "weights.pt"))
    varied = varied_jpegs()
    params = detector.params()
    refs = []
    for _, data in varied:
        r = model.predict(decode_image(data), imgsz=640, rect=detector.shape.letterbox == "rect", conf=params.conf,
                          iou=params.iou, quantize=detector.precision, device=0, verbose=False)[0].boxes
        refs.append((r.xyxy.cpu().numpy(), r.conf.cpu().numpy(), r.cls.cpu().numpy().astype(int)))
    rows = []
    for decode in ("gpu", "opencv"):
        decoding = detector.reshaped(decode=decode)  # the same pipeline, its runs decoding with this
        dets = decoding.detect([d for _, d in varied], params)
        pairs = [(ref, (d.detections.boxes, d.detections.scores, d.detections.class_ids)) for ref, d in zip(refs, dets)
                 if d.detections is not None]
        rows.append({"system": "fidelity", "backend": detector.backend, "precision": detector.precision,
                     "input": "jpeg", "batch": detector.shape.max_batch, "decode": decoding.diagnose().decoder,
                     "images": len(varied),
                     "errors": sum(d.error is not None for d in dets), "agreement": agreement(pairs),
                     "img_per_s": None, "p50_ms": None, "p99_ms": None,
                     "reference": "Ultralytics predict, same precision, on OpenCV's decode of each file"})
    return rows


def _tensorrt_precisions(model_dir) -> list[str]:
    try:
        from app.artifacts.engines import find_engine

        return [p for p in ENGINE_PRECISIONS if find_engine(model_dir, p) is not None]
    except Exception:  # noqa: BLE001 - tensorrt or its engines absent: no TensorRT rows
        return []
