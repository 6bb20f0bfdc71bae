"""The naive baseline: a minimal FastAPI app that calls Ultralytics ``predict`` once per request.

What most people write first; ``bench/http_load.py`` measures it in the same run as yolopipe.
It speaks yolopipe's ``POST /v1/detect`` (raw ``image/*`` body or multipart field ``image``)
and ``GET /readyz``, so the same load generator drives both.

    python bench/naive_server.py --weights engines/sample/weights.pt --port 8100 [--workers 4] [--device 0]
"""

from __future__ import annotations

import argparse
import os

import cv2
import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool

WEIGHTS = os.environ.get("NAIVE_WEIGHTS", "yolov8n.pt")
DEVICE = os.environ.get("NAIVE_DEVICE", "cpu")

app = FastAPI(title="naive ultralytics server")
model = None


@app.on_event("startup")
def load_model() -> None:
    global model
    from ultralytics import YOLO

    model = YOLO(WEIGHTS)
    model.predict(np.zeros((640, 640, 3), np.uint8), imgsz=640, device=DEVICE, verbose=False)  # warm up


@app.get("/readyz")
def readyz() -> dict:
    return {"status": "ready" if model is not None else "loading"}


@app.post("/v1/detect")
async def detect(request: Request) -> dict:
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form()
        data = await form["image"].read()
    else:
        data = await request.body()
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if img is None:
        raise HTTPException(400, "not an image")
    # The usual pattern: a sync predict per request in FastAPI's thread pool.
    result = (await run_in_threadpool(model.predict, img, imgsz=640, conf=0.25, iou=0.7, device=DEVICE,
                                      verbose=False))[0]
    boxes = result.boxes
    return {
        "width": img.shape[1],
        "height": img.shape[0],
        "detections": [
            {"box": [round(float(v), 2) for v in box], "score": round(float(s), 5), "class_id": int(c),
             "class_name": result.names[int(c)]}
            for box, s, c in zip(boxes.xyxy.tolist(), boxes.conf.tolist(), boxes.cls.tolist())
        ],
    }


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=WEIGHTS)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--device", default=DEVICE, help="'cpu' or a CUDA index like 0")
    args = parser.parse_args()
    # Workers import this module afresh: hand them the choices through the environment.
    os.environ["NAIVE_WEIGHTS"], os.environ["NAIVE_DEVICE"] = args.weights, args.device
    os.environ.setdefault("YOLO_OFFLINE", "1")
    uvicorn.run("naive_server:app", app_dir=os.path.dirname(os.path.abspath(__file__)), host=args.host,
                port=args.port, workers=args.workers, access_log=False, log_level="warning")


if __name__ == "__main__":
    main()
