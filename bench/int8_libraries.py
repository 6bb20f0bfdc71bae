"""The INT8 comparison (issues #20, #39): yolopipe's two models against NNCF and ModelOpt, one run,
the same images: each calibrated on the 84 images a new user would give, scored against FP32 on
108 of another distribution (``bench/int8_heldout.py``) through the serving path (F1 at conf 0.25
with its bootstrap 95 % interval), then CPU latency at batch 1, all rows interleaved.

* yolopipe: ``yolopipe calibrate`` with default options (timed; on a GPU it distils), both
  models; then (``--runs``) ``--max-float-layers 12`` and ``--method percentile`` from its caches;
* NNCF PTQ (performance preset; the head tail and Sigmoid ignored as Ultralytics' OpenVINO export
  ignores them) where ``nncf`` imports; ModelOpt ONNX PTQ (int8, entropy) with ``--modelopt-python``.

    python bench/int8_libraries.py --data DATA_DIR --modelopt-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from app.benchmark.machine import machine_info, versions
from app.builder.export import export_onnx
from app.builder.int8.calibration import load_heldout
from app.builder.int8.images import letterboxed, list_items
from app.builder.int8.report import OrtModel, detect, summarize
from app.imaging.letterbox import letterbox, to_input
from bench.int8_heldout import make_calibration, make_heldout

ASSETS = Path(importlib.util.find_spec("ultralytics").origin).parent / "assets"


def batch1(src: Path, dst: Path) -> Path:
    """The FP32 model with a static batch of 1 (the libraries calibrate one image per run)."""
    import onnx

    model = onnx.load(str(src))
    for vi in [*model.graph.input, *model.graph.output]:
        vi.type.tensor_type.shape.dim[0].dim_value = 1
    del model.graph.value_info[:]
    onnx.save(onnx.shape_inference.infer_shapes(model), str(dst))
    return dst


def calibration_inputs(folder: Path, imgsz: int) -> list[np.ndarray]:
    return [to_input([image]) for _, image, _ in letterboxed(list_items(folder), imgsz)]


def run_nncf(fp32: Path, out: Path, inputs: list[np.ndarray]) -> float:
    import nncf
    import onnx

    model = onnx.load(str(fp32))
    # Ultralytics' OpenVINO INT8 export ignores the Detect head's Add/Sub/Mul/Div, its DFL and
    # every Sigmoid (ultralytics/engine/exporter.py); the same patterns on the ONNX names.
    head = r"/model\.22/"
    scope = nncf.IgnoredScope(patterns=[f".*{head}Add.*", f".*{head}Sub.*", f".*{head}Mul.*", f".*{head}Div.*",
                                        f".*{head}dfl/.*"], types=["Sigmoid"], validate=False)
    t0 = time.perf_counter()
    quantized = nncf.quantize(model, nncf.Dataset(inputs, lambda x: {"images": x}),
                              preset=nncf.QuantizationPreset.PERFORMANCE, subset_size=len(inputs), ignored_scope=scope)
    onnx.save(quantized, str(out))
    return time.perf_counter() - t0


def run_modelopt(python: str, fp32: Path, out: Path, inputs: list[np.ndarray], work: Path) -> float:
    data = work / "modelopt-calib.npy"
    np.save(data, np.concatenate(inputs))
    t0 = time.perf_counter()
    subprocess.run([python, "-m", "modelopt.onnx.quantization", "--onnx_path", str(fp32), "--quantize_mode", "int8",
                    "--calibration_method", "entropy", "--calibration_data_path", str(data),
                    "--calibration_eps", "cpu", "--output_path", str(out)], check=True)
    return time.perf_counter() - t0


def interleaved_latency(models: dict[str, Path], *, rounds: int = 30, imgsz: int = 640, warmup: int = 3) -> dict:
    """Engine time at batch 1 (``session.run`` on one letterboxed photo), every model once a round
    in a rotating order, so the load of a shared CPU hits every row alike."""
    import cv2

    x = to_input([letterbox(cv2.imread(str(ASSETS / "bus.jpg")), imgsz)[0]])
    sessions = {name: OrtModel(path) for name, path in models.items()}
    names = list(sessions)
    for _ in range(warmup):
        for name in names:
            sessions[name].run(x)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t = time.perf_counter()
            sessions[name].run(x)
            times[name].append((time.perf_counter() - t) * 1e3)
    return {name: {"median_ms": round(float(np.median(t)), 1), "p90_ms": round(float(np.percentile(t, 90)), 1),
                   "min_ms": round(float(np.min(t)), 1), "runs": len(t)} for name, t in times.items()}


def cpu_flags() -> list[str]:
    """The x86 features ONNX Runtime's int8 kernels depend on (VNNI: no u8×s8 saturation)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return sorted(flags & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8"})


def figures(report) -> dict:
    return {"f1": round(report.f1, 4), "f1_ci95": [round(v, 4) for v in report.f1_ci95],
            "precision": round(report.precision, 4), "recall": round(report.recall, 4),
            "f1_conf01": round(report.f1_conf01, 4), "map50": None if report.map50 is None else round(report.map50, 4),
            "fp32_boxes": report.fp32_boxes, "int8_boxes": report.int8_boxes,
            "mean_score_drift": round(report.mean_score_drift, 4), "lost_all": len(report.lost_all)}


# yolopipe command runs: label and extra options (all on the same images; later runs read the first's caches).
RUNS = {
    "default": ("default options", []),
    "float12": ("--max-float-layers 12", ["--max-float-layers", "12"]),
    "percentile": ("--method percentile", ["--method", "percentile"]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--modelopt-python", default=None, help="a Python with nvidia-modelopt[onnx] (skipped if none)")
    ap.add_argument("--runs", default="default,float12,percentile", help=f"yolopipe runs, of {', '.join(RUNS)}")
    ap.add_argument("--nncf", choices=("auto", "yes", "no"), default="auto", help="auto: when nncf imports")
    ap.add_argument("--import", dest="imports", action="append", default=[], metavar="NAME=PATH",
                    help="another model to score in the same run")
    ap.add_argument("--calibration", type=Path, default=None,
                    help="calibrate every model on this folder instead of making the 84 images from --data")
    ap.add_argument("--photo-cache", type=Path, default=None,
                    help="holds skimage/*.png for the held-out set (bench/int8_heldout.py), where pip cannot fetch")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--work", type=Path, default=None, help="keep the sets and models here")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--tag", default="-cpu", help="the result file's name ends with it (keeps an earlier run's file)")
    args = ap.parse_args()
    runs = [r for r in args.runs.split(",") if r]
    if runs[:1] != ["default"] or any(r not in RUNS for r in runs):
        ap.error(f"--runs starts with default and names runs of {', '.join(RUNS)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="yolopipe-int8-libs-"))
    calib_dir = args.calibration or make_calibration(args.data, work / "calibration")
    held_dir = make_heldout(args.data, work / "heldout", args.photo_cache or work / "cache")
    load_before = os.getloadavg()

    # yolopipe: the command a user runs, defaults, on an export of its own (the export is not timed).
    engines = work / "engines"
    sample = export_onnx("sample").model_dir
    private = engines / sample.relative_to(sample.parent.parent)
    private.mkdir(parents=True, exist_ok=True)
    for f in ("model.onnx", "meta.json", "weights.pt"):
        shutil.copyfile(sample / f, private / f)
    cli = [sys.executable, "-m", "app.cli", "calibrate", "--images", str(calib_dir), "--artifacts-dir", str(engines)]
    rows, run_info = {}, {}
    for key in runs:
        label, extra = RUNS[key]
        t0 = time.perf_counter()
        proc = subprocess.run([*cli, *extra], capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - t0
        sys.stderr.write(proc.stderr[-6000:])
        own = json.loads((private / "int8_report.json").read_text())
        run_info[label] = {"command_options": extra, "exit_status": proc.returncode, "wall_s": round(seconds, 1),
                           "histograms_from_cache": own["cache_hit"], "own_heldout_images": len(own["heldout_images"]),
                           "own_report_f1": {"tensorrt": round(own["f1"], 4), "cpu": round(own["cpu_variant"]["f1"], 4)},
                           "mixed_precision": {t: v["layers"] for t, v in own["mixed_precision"].items()},
                           "timings_s": own["timings_s"]}
        suffix = "" if not extra else f" ({label})"
        for name in ("model.int8-cpu.onnx", "model.int8.onnx"):
            kept = work / f"{label.replace(' ', '_').strip('-')}-{name}"
            shutil.copyfile(private / name, kept)
            title = f"yolopipe {name}" + (" (TensorRT-bound, run in ORT)" if name == "model.int8.onnx" else "")
            rows[title + suffix] = {"path": kept, "calibration_s": seconds}
    for spec in args.imports:
        name, _, path = spec.partition("=")
        rows[name] = {"path": Path(path), "calibration_s": None}

    fp32 = private / "model.onnx"
    fp32_b1 = batch1(fp32, work / "model-b1.onnx")
    inputs = calibration_inputs(calib_dir, 640)
    has_nncf = importlib.util.find_spec("nncf") is not None
    if args.nncf == "yes" or (args.nncf == "auto" and has_nncf):
        nncf_path = work / "nncf.onnx"
        rows["NNCF PTQ performance preset, Ultralytics' ignored scope"] = {
            "path": nncf_path, "calibration_s": run_nncf(fp32_b1, nncf_path, inputs)}
    if args.modelopt_python:
        mo_path = work / "modelopt.onnx"
        rows["ModelOpt ONNX PTQ int8 entropy"] = {
            "path": mo_path, "calibration_s": run_modelopt(args.modelopt_python, fp32_b1, mo_path, inputs, work)}
    del inputs

    heldout = load_heldout(list_items(held_dir), 640, held_dir, None)
    reference = detect(fp32, heldout)
    for name, row in rows.items():
        row["heldout"] = figures(summarize(name, heldout.names, reference, detect(row["path"], heldout, batch=1)))
        print(name, row["heldout"], flush=True)
    latency = interleaved_latency({"fp32": fp32, **{name: row["path"] for name, row in rows.items()}},
                                  rounds=args.rounds)
    fp32_ms = latency["fp32"]["median_ms"]
    result = {
        "bench": "int8-libraries",
        "issues": [20, 29, 39],
        "date": dt.date.today().isoformat(),
        "machine": {**machine_info(), "load_average_at_start": [round(v, 2) for v in load_before],
                    "cpu_flags": cpu_flags(),
                    "note": "every model scored and timed with ONNX Runtime on this machine's CPU; latency rows "
                            "interleaved in one loop so the load hit them alike"},
        "versions": versions(("onnxruntime", "onnx", "numpy", "nncf", "opencv-python-headless", "torch")),
        "modelopt": subprocess.run([args.modelopt_python, "-c", "import modelopt; print(modelopt.__version__)"],
                                   capture_output=True, text=True, check=False).stdout.strip() if args.modelopt_python else None,
        "model": "sample (YOLOv8s-size, 2 classes), imgsz 640",
        "calibration_set": "84 images: the 20 photos of images/ + every 3rd frame of dance.avi (64 frames)"
                           + (f", from {args.calibration}" if args.calibration else ""),
        "heldout_set": f"{len(heldout)} images of another distribution (bench/int8_heldout.py), "
                       f"{rows[next(iter(rows))]['heldout']['fp32_boxes']} FP32 boxes at conf 0.25",
        "yolopipe_command": "yolopipe calibrate --images <84 images> with default options, then the other runs "
                            "(yolopipe_runs: their options), which read the first run's caches",
        "yolopipe_runs": run_info,
        "libraries_left_out": [name for name, present in (("nncf", has_nncf), ("modelopt", bool(args.modelopt_python)))
                               if not present],
        "rows": [{"model": name, "calibration_s": None if row["calibration_s"] is None else round(row["calibration_s"], 1),
                  **row["heldout"], "latency_ms": latency[name]["median_ms"],
                  "latency_over_fp32": round(latency[name]["median_ms"] / fp32_ms, 3)} for name, row in rows.items()],
        "fp32_latency_ms": latency["fp32"],
        "latency": latency,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{result['date']}-int8-libraries{args.tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
