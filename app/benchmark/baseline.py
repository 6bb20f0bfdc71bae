"""The baseline, measured in the same run: Ultralytics' own ``predict`` on the same weights and
images (per batch call, and over the same folder), and its NMS alone."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from app.benchmark.timing import Budget, batch_of, row
from app.config import CONF, IOU, MAX_DET



def ultralytics_rows(weights: Path, images, batches, precisions, device, budget: Budget, iters: int,
                     warmup: int) -> list[dict]:
    """``YOLO.predict`` on a list of decoded frames, and on JPEG bytes decoded with OpenCV first."""
    import cv2
    from ultralytics import YOLO

    rows = []
    frames = [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for _, d in images]
    datas = [d for _, d in images]
    for precision in precisions:
        model = YOLO(str(weights))
        for b in batches:
            fr, by = batch_of(frames, b), batch_of(datas, b)

            def on_frames(fr=fr, model=model, quant=precision):
                return model.predict(fr, imgsz=640, rect=False, conf=CONF, iou=IOU, quantize=quant, device=device,
                                     verbose=False)

            def on_jpeg(by=by, model=model, quant=precision):
                decoded = [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for d in by]
                return model.predict(decoded, imgsz=640, rect=False, conf=CONF, iou=IOU, quantize=quant,
                                     device=device, verbose=False)

            for input_, fn in (("frames", on_frames), ("jpeg", on_jpeg)):
                times = budget.measure(fn, iters, warmup)
                speed = fn()[0].speed  # Ultralytics' own per-image split of the last call (ms)
                rows.append(row("ultralytics", "torch" if device != "cpu" else "torch-cpu", precision, input_, b,
                                times, mode="serial", decode="opencv",
                                ultralytics_speed_ms={k: round(v, 4) for k, v in speed.items()}))
    return rows


def ultralytics_folder_row(weights: Path, folder: Path, n_images: int, batch: int, precision: str, device,
                           max_s: float) -> dict:
    """``YOLO.predict(folder, stream=True, batch=...)`` end to end: its own file reading and
    OpenCV decoding, inference, NMS, results on the host. Stops after ``max_s`` seconds (the
    row then says how many images it did)."""
    from ultralytics import YOLO

    model = YOLO(str(weights))
    # Warm-up on a few files (model fusing, cuDNN autotune): not timed.
    for _ in model.predict(source=str(folder), stream=True, batch=batch, imgsz=640, conf=CONF, iou=IOU,
                           quantize=precision, device=device, verbose=False, max_det=MAX_DET):
        break
    done, dets = 0, 0
    t0 = time.perf_counter()
    for res in model.predict(source=str(folder), stream=True, batch=batch, imgsz=640, conf=CONF, iou=IOU,
                             quantize=precision, device=device, verbose=False, max_det=MAX_DET):
        dets += len(res.boxes.cls.cpu())
        done += 1
        if time.perf_counter() - t0 > max_s:
            break
    wall = time.perf_counter() - t0
    return {"system": "ultralytics", "backend": "torch" if device != "cpu" else "torch-cpu", "precision": precision,
            "input": "folder", "batch": batch, "mode": "folder", "decode": "opencv", "images": done,
            "folder_images": n_images, "detections": dets, "wall_s": round(wall, 3),
            "img_per_s": round(done / wall, 1) if wall > 0 else None, "p50_ms": None, "p99_ms": None,
            "timing": "YOLO.predict(folder, stream=True): file reads, decode, inference, NMS, boxes to the host"}


def ultralytics_nms_row(head: np.ndarray, conf: float, gpu: bool, budget: Budget, iters: int, warmup: int,
                        n_cand: int) -> dict:
    import torch
    from ultralytics.utils.nms import non_max_suppression

    pred = torch.from_numpy(head).to("cuda" if gpu else "cpu")

    def call():
        non_max_suppression(pred, conf_thres=conf, iou_thres=IOU, max_det=MAX_DET)
        if gpu:
            torch.cuda.synchronize()

    times = budget.measure(call, iters, warmup)
    return row("ultralytics", "torch" if gpu else "torch-cpu", "fp32", "nms", head.shape[0], times, conf=conf,
               candidates=n_cand)
