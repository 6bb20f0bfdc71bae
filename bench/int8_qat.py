"""Quantization-aware distillation against PTQ in one run (issue #29): the GPU proof of ``calibrate --qat``.

Export → calibration (PTQ, ``--method``, default entropy: TensorRT's) → distillation of both written
models (``--qat-seconds``, both models together; on a CUDA GPU when torch sees one) → both the PTQ
and the distilled models scored against the FP32 model on held-out images (F1 with its bootstrap
interval, mAP50: ``calibration/README.md``, "The report and the gate"). It is ``yolopipe calibrate
--qat`` with the gate off (``allow_low_accuracy``) and mixed precision off by default (PTQ against
QAT, nothing else moved), in its own artifacts folder.

Images: ``--images`` is the held-out folder (scored on, never trained on). ``--calib`` is what the
models are calibrated and distilled on: a video (``--frames-per-video`` frames) or a folder; left
out, the clip ``--clip`` if it exists (another distribution than the photos), else ``--images``
itself split with 4 held out (16 of the 20 shared photos trained on: the minimum for ``--qat``).

The JSON result is rewritten as it goes (``status``: running, done or failed; the machine line
and versions first), so a run cut off keeps what it did. ``bench/device.sh int8`` runs it on the
lent GPU.

    python bench/int8_qat.py --images .data/images --out /tmp/int8-qat.json
    python bench/int8_qat.py --images DIR --calib VIDEO --qat-seconds 20 --imgsz 320 --out FILE   # a dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.benchmark.machine import PACKAGES, machine_info, versions  # noqa: E402

FIGURES = ("f1", "f1_ci95", "precision", "recall", "map50", "mean_score_drift", "images", "fp32_boxes", "int8_boxes",
           "lost_all", "warnings")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, required=True, help="held-out photos, scored against FP32")
    p.add_argument("--calib", type=Path, help="a video or folder to calibrate and distill on [default: --clip if it "
                                               "exists, else --images split with 4 held out]")
    p.add_argument("--clip", type=Path, default=Path(".data/video/dance-1080p30.mp4"))
    p.add_argument("--frames-per-video", type=int, default=64)
    p.add_argument("--weights", default="sample")
    p.add_argument("--method", default="entropy", help="the PTQ method (calibrate --method)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--qat-seconds", type=float, default=240.0, help="the distillation's time limit, both models")
    p.add_argument("--qat-steps", type=int, default=3000, help="steps per model at most")
    p.add_argument("--max-float-layers", type=int, default=0, help="mixed precision (calibrate's option); 0: off")
    p.add_argument("--artifacts-dir", type=Path, default=Path("/tmp/int8-qat-artifacts"))
    p.add_argument("--out", type=Path, required=True, help="the JSON result")
    return p.parse_args(argv)


def figures(report) -> dict:
    data = report.to_json()
    return {k: data[k] for k in FIGURES}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("YOLO_OFFLINE", "1")
    from rich.console import Console

    from app.builder.int8 import calibrate
    from app.builder.int8.distill import DistillSettings, resolve_device
    from app.errors import YolopipeError

    if args.calib is not None:
        calib, heldout, holdout = args.calib, args.images, None
    elif args.clip.is_file():
        calib, heldout, holdout = args.clip, args.images, None
    else:
        calib, heldout, holdout = args.images, None, 4
    device = resolve_device("auto")
    result = {"bench": "int8_qat", "status": "running", "machine": machine_info(gpu=device == "cuda"), "versions": versions(PACKAGES),
              "settings": {"weights": args.weights, "method": args.method, "imgsz": args.imgsz,
                           "calibration": str(calib), "heldout": str(heldout or f"{args.images} (4 held out)"),
                           "frames_per_video": args.frames_per_video, "qat_seconds": args.qat_seconds,
                           "qat_steps": args.qat_steps, "max_float_layers": args.max_float_layers,
                           "distill_device": device, "reference": "the FP32 ONNX model, ONNX Runtime"}}

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(args.out)

    try:
        import pycocotools  # noqa: F401
    except ImportError:  # a device carry built without it: F1 still counts, mAP50 is left out and says why
        from app.builder.int8 import report as report_module

        report_module.map50 = lambda fp32, int8: None
        result["settings"]["map50"] = "not measured: pycocotools is not importable (bench/device_carry.sh carries it)"
    write()
    t0 = time.perf_counter()
    try:
        run = calibrate(
            args.weights, calib, method=args.method, imgsz=args.imgsz, artifacts_dir=args.artifacts_dir,
            allow_low_accuracy=True, console=Console(stderr=True), heldout_images=heldout,
            **({"holdout": holdout} if holdout else {}), frames_per_video=args.frames_per_video,
            max_float_layers=args.max_float_layers, qat=True,
            distill_settings=DistillSettings(steps=args.qat_steps, time_limit_s=args.qat_seconds))
    except YolopipeError as exc:
        result.update(status="failed", error=str(exc), seconds=round(time.perf_counter() - t0, 1))
        write()
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    result.update(status="done", seconds=round(time.perf_counter() - t0, 1), timings_s=run.timings_s,
                  calibration_images=len(run.calibration_images), heldout_images=run.heldout_images,
                  report=str(run.report_path), models={})
    for target, qat_report in (("tensorrt", run.report), ("cpu", run.cpu_report)):
        ptq = run.ptq_reports[target]
        result["models"][target] = {"ptq": figures(ptq), "qat": figures(qat_report),
                                    "distillation": run.distilled[target].to_json()}
    write()
    for target, row in result["models"].items():
        d = row["distillation"]
        print(f"{target}: F1 vs FP32 PTQ {row['ptq']['f1']:.4f} {row['ptq']['f1_ci95']} mAP50 {row['ptq']['map50']}"
              f" → QAT {row['qat']['f1']:.4f} {row['qat']['f1_ci95']} mAP50 {row['qat']['map50']}"
              f" ({d['steps']} steps on {d['device']}, {d['seconds']:.0f} s, kept step {d['kept_step']})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
