"""CPU latency at batch 1: FP32 vs INT8 in ONNX Runtime, interleaved in one run.

Rows: ``model.onnx`` (FP32), ``model.int8-cpu.onnx`` (what ``--backend onnxruntime --precision
int8`` runs: u8 activations, s8 per-channel weights, fused QLinear kernels) and, for reference,
``model.int8.onnx`` (the TensorRT-bound s8 symmetric Q/DQ model, which ONNX Runtime runs but does
not fuse as well). Each round runs every model once on the same letterboxed photo, in a rotating
order, so the load of the shared CPU hits all rows alike. Engine time only (``session.run``), no
decode, letterbox or NMS.

    python bench/int8_cpu_latency.py --model-dir <artifacts folder of the calibrated model> [--rounds 40]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.builder.int8.report import OrtModel
from app.imaging.letterbox import letterbox, to_input
from app.benchmark.machine import machine_info, versions

ASSETS = Path(__import__("ultralytics").__file__).parent / "assets"


def interleaved_latency(models: dict[str, Path], *, rounds: int = 30, imgsz: int = 640, warmup: int = 3) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, required=True, help="the artifacts folder yolopipe calibrate wrote into")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    models = {"fp32": args.model_dir / "model.onnx", "int8": args.model_dir / "model.int8-cpu.onnx",
              "int8-tensorrt-qdq": args.model_dir / "model.int8.onnx"}
    missing = [str(p) for p in models.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run `yolopipe calibrate` (or bench/int8_calibration.py) first")
    load = os.getloadavg()
    rows = interleaved_latency(models, rounds=args.rounds)
    fp32 = rows["fp32"]["median_ms"]
    report = json.loads((args.model_dir / "int8_report.json").read_text()) if (args.model_dir / "int8_report.json").is_file() else {}
    result = {
        "bench": "cpu-2core-int8",
        "date": dt.date.today().isoformat(),
        "machine": {**machine_info(), "load_average_at_start": [round(v, 2) for v in load],
                    "note": "2 CPU cores shared with other work; the rows were measured interleaved (rotating order, "
                            "same input) in one run, so the load hit them alike"},
        "versions": versions(("onnxruntime", "onnx", "numpy", "opencv-python-headless")),
        "model": "sample (YOLOv8s-size, 2 classes), imgsz 640, batch 1, ONNX Runtime CPUExecutionProvider, "
                 f"intra-op threads {os.cpu_count()}, engine time only",
        "calibration": {k: report.get(k) for k in ("method", "calibration_images", "f1", "f1_ci95")} if report else None,
        "rows": [{"precision": name, "model": models[name].name, **row} for name, row in rows.items()],
        "int8_over_fp32": round(rows["int8"]["median_ms"] / fp32, 3),
        "goal": "int8 <= 0.55x fp32",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{result['date']}-cpu-2core-int8.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["rows"]), result["int8_over_fp32"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
