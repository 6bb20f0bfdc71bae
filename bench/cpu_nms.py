"""CPU NMS at a low confidence: the NumPy reference, the compiled CPU NMS yolopipe runs, and
Ultralytics' ``non_max_suppression`` (torchvision), on the same real head outputs, in one run.

    python bench/cpu_nms.py --out bench/results/2026-11-30-cpu-2core-nms.json

Head outputs come from the sample model's ONNX export on Ultralytics' example photos and
flipped/resized variants (batch 16). The three rows are timed interleaved, round by round, so a
busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cv2  # noqa: E402
import numpy as np  # noqa: E402

from app.benchmark.machine import machine_info, versions  # noqa: E402
from app.boxes import nms_numpy  # noqa: E402
from app.builder.export import export_onnx  # noqa: E402
from app.contracts import DetectParams  # noqa: E402
from app.imaging.letterbox import letterbox, to_input  # noqa: E402
from app.pipeline.nms_cpu import nms_keep_indices_cpu  # noqa: E402


def head_outputs(batch: int) -> np.ndarray:
    import importlib.util

    import onnxruntime as ort

    assets = Path(importlib.util.find_spec("ultralytics").origin).parent / "assets"
    photos = [cv2.imread(str(p)) for p in sorted(assets.glob("*.jpg"))]
    variants = [v for img in photos for v in (img, img[:, ::-1], cv2.resize(img, None, fx=0.6, fy=0.6))]
    images = [variants[i % len(variants)] for i in range(batch)]
    onnx_path = export_onnx("sample").onnx_path
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    x = to_input([letterbox(img, 640)[0] for img in images])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--conf", type=float, default=0.001)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("bench-cpu-nms.json"))
    args = parser.parse_args()

    import torch
    from ultralytics.utils.nms import non_max_suppression

    heads = head_outputs(args.batch)
    params = DetectParams(conf=args.conf, iou=0.7, max_det=300)
    heads_t = torch.from_numpy(heads)
    systems = {
        "numpy-reference": lambda: [nms_numpy(h, params) for h in heads],
        "yolopipe-cpu": lambda: [nms_numpy(h, params, nms_keep_indices_cpu) for h in heads],
        "ultralytics": lambda: non_max_suppression(heads_t, args.conf, 0.7, max_det=300),
    }
    same = all(np.array_equal(a, b) for a, b in zip(systems["numpy-reference"](), systems["yolopipe-cpu"]()))
    theirs = systems["ultralytics"]()
    same_as_ultralytics = all(
        {tuple(r) for r in a.tolist()} == {tuple(r) for r in b.numpy().tolist()}
        for a, b in zip(systems["yolopipe-cpu"](), theirs)
    )
    times = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, run in systems.items():
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) * 1e3)
    candidates = int(sum((h[4:].max(0) > args.conf).sum() for h in heads))
    rows = [{"system": name, "input": "head-output", "batch": args.batch, "conf": args.conf,
             "p50_ms": round(statistics.median(t), 3), "min_ms": round(min(t), 3), "rounds": len(t)}
            for name, t in times.items()]
    result = {"machine": machine_info(), "versions": versions(), "load_average_1m": round(os.getloadavg()[0], 2),
              "candidates_per_batch": candidates,
              "same_rows_as_reference": same, "same_rows_as_ultralytics": same_as_ultralytics,
              "note": "rows timed interleaved, round by round", "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(f"{row['system']:>16}: p50 {row['p50_ms']:8.3f} ms  min {row['min_ms']:8.3f} ms")
    print(f"candidates per batch {candidates}; same rows as the reference: {same}; as Ultralytics: {same_as_ultralytics}")


if __name__ == "__main__":
    main()
