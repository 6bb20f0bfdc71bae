"""yolopipe's ``predict`` against ``yolo predict``'s defaults on a folder of photos and a video.

What users compare against is Ultralytics' ``model.predict(source)`` on the ``.pt`` with its
defaults: batch 1 and rect letterboxing (each image padded only up to the next multiple of the
stride). This runs the real ``yolopipe predict`` (a subprocess, ONNX Runtime on the CPU, FP32)
on the photos and on the video, once per letterbox (rect, its default; ``--square``), and
Ultralytics on the same files (its own reading of them, frame by frame for the video), and
writes one row per (set, letterbox, reference): F1 at IoU 0.5, same class, and the largest
|Δscore| of a matched box (``app.benchmark.fidelity.agreement``). The references: Ultralytics'
defaults, and for ``--square`` also ``rect=False`` (what square equals).

    python3 bench/rect_fidelity.py                      # Ultralytics' two example photos
    python3 bench/rect_fidelity.py --images DIR --video clip.avi --out rect-fidelity.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a checkout without `pip install -e`

import numpy as np


CONF, IOU = 0.25, 0.7  # both sides' defaults, said once


def assets_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("ultralytics")
    return Path(spec.origin).parent / "assets"


def yolopipe_predict(source: Path, *, square: bool, weights: str, artifacts_dir: Path | None) -> dict:
    """``yolopipe predict SOURCE`` as a user runs it (ONNX Runtime): its lines by (image, frame)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        cmd = [sys.executable, "-m", "app.cli", "predict", str(source), "--out", str(out), "--weights", weights,
               "--backend", "onnxruntime", "--precision", "fp32", *(["--square"] if square else []),
               *(["--artifacts-dir", str(artifacts_dir)] if artifacts_dir else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
        records = [json.loads(line) for line in out.read_text().splitlines()]
    found = {}
    for r in records:
        dets = r.get("detections", [])
        found[(r["image"], r.get("frame"))] = (np.array([d["box"] for d in dets], np.float32).reshape(-1, 4),
                                                np.array([d["score"] for d in dets], np.float32),
                                                np.array([d["class_id"] for d in dets], int))
    return found


def boxes_of(result) -> tuple:
    b = result.boxes
    return b.xyxy.numpy(), b.conf.numpy(), b.cls.numpy().astype(int)


def ultralytics_images(model, folder: Path, names: list[str], **kwargs) -> dict:
    """Each photo alone, as ``yolo predict source=DIR`` runs them (batch 1), by name."""
    return {(name, None): boxes_of(model.predict(str(folder / name), conf=CONF, iou=IOU, verbose=False, **kwargs)[0])
            for name in names}


def ultralytics_video(model, video: Path, **kwargs) -> dict:
    """Every frame as Ultralytics reads the video itself, by frame index."""
    results = model.predict(str(video), stream=True, conf=CONF, iou=IOU, verbose=False, **kwargs)
    return {(video.name, k): boxes_of(r) for k, r in enumerate(results)}


def row(set_name: str, letterbox: str, reference: str, ours: dict, theirs: dict) -> dict:
    from app.benchmark.fidelity import agreement

    missing = sorted(set(theirs) ^ set(ours), key=str)
    if missing:
        raise SystemExit(f"{set_name}: images or frames on one side only: {missing[:5]}")
    keys = sorted(theirs, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    return {"set": set_name, "letterbox": letterbox, "reference": reference, "images": len(keys),
            **agreement([(theirs[k], ours[k]) for k in keys], conf=CONF)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, default=None, help="a folder of photos [default: Ultralytics' assets]")
    parser.add_argument("--video", type=Path, default=None, help="a video file [default: none]")
    parser.add_argument("--weights", default="sample")
    parser.add_argument("--artifacts-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("rect-fidelity.json"))
    args = parser.parse_args()
    os.environ.update(YOLO_OFFLINE="1", YOLO_VERBOSE="False")
    from ultralytics import YOLO

    from app.benchmark.machine import PACKAGES, code_revision, machine_info
    from app.files import list_images
    from app.imaging.headers import IMAGE_SUFFIXES
    from app.versions import package_versions
    from app.weights import resolve_weights

    images = args.images or assets_dir()
    names = [img.name for img in list_images(str(images), IMAGE_SUFFIXES)]
    model = YOLO(str(resolve_weights(args.weights).path))
    commit, started = code_revision(), time.perf_counter()  # the code that runs: read before it does
    sets = [("images", images, lambda **kw: ultralytics_images(model, images, names, **kw))]
    if args.video is not None:
        sets.append(("video", args.video, lambda **kw: ultralytics_video(model, args.video, **kw)))
    rows = []
    for set_name, source, reference in sets:
        defaults, square_ref = reference(), reference(rect=False)
        rect = yolopipe_predict(source, square=False, weights=args.weights, artifacts_dir=args.artifacts_dir)
        square = yolopipe_predict(source, square=True, weights=args.weights, artifacts_dir=args.artifacts_dir)
        if set_name == "video":  # the lines name the video as given, relative to itself
            rect, square = ({(source.name, f): v for (_, f), v in found.items()} for found in (rect, square))
        rows.append(row(set_name, "rect", "model.predict(source) defaults", rect, defaults))
        rows.append(row(set_name, "square", "model.predict(source) defaults", square, defaults))
        rows.append(row(set_name, "square", "model.predict(source, rect=False)", square, square_ref))
        for r in rows[-3:]:
            print(f"{r['set']:6} {r['letterbox']:6} vs {r['reference']:34} F1 {r['f1']:.4f}  "
                  f"max |dscore| {r['max_abs_dscore']:.5f}  ({r['tp']} of {r['n_ref']} boxes, {r['n_ours']} ours)")
    result = {
        "benchmark": "rect_fidelity", "commit": commit, "machine": machine_info(),
        "versions": package_versions(PACKAGES), "weights": args.weights, "images": str(images),
        "video": str(args.video) if args.video else None, "backend": "onnxruntime", "precision": "fp32",
        "conf": CONF, "iou": IOU, "seconds": round(time.perf_counter() - started, 1), "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
