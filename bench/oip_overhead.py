"""What one request costs the HTTP worker on each protocol, inference left out: ``/v1/detect``
(multipart, as bench/wrk/multipart.lua sends it) against ``/v2/models/yolopipe/infer``
(binary tensor data, as bench/wrk/oip.lua and tritonclient send it).

The app is the service's own (``create_app``: middleware, routes, header checks, parameter
validation, response building) in front of an inference client that answers at once with
the same canned detections for every image; each request is driven through the ASGI
interface in this process, so the figure is the HTTP worker's CPU per request, without
uvicorn's parsing (the same for both). Rounds alternate between the two, and the median
round is reported.

    python bench/oip_overhead.py --out bench/results/<date>-oip-overhead-<machine>.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.api.main import create_app  # noqa: E402
from app.api.oip.tensors import join_bytes_tensor  # noqa: E402
from app.benchmark.machine import machine_info, versions  # noqa: E402
from app.config import Settings  # noqa: E402
from app.contracts import DetectedBatch  # noqa: E402
from app.ipc.answers import Answers, tickets  # noqa: E402
from app.types import Detections  # noqa: E402

BOUNDARY = "yolopipe-wrk-boundary-7d1c2b"


class CannedInference:
    """The inference client's interface, answering every image with the same detections."""

    info = {"class_names": ["Normal", "Fall"], "backend": "onnxruntime"}
    ready = True

    def __init__(self, detections: Detections, run_folder: Path) -> None:
        self.detections = detections
        self.layout = SimpleNamespace(root=run_folder)  # the run folder (the OIP routes' shared-memory registry)

    async def detect(self, images: list[bytes], params: object, headers: object = None) -> Answers:
        n, d = len(images), self.detections
        rows = np.concatenate([d.boxes, d.scores[:, None], d.class_ids[:, None].astype(np.float32)], 1)
        batch = DetectedBatch(np.full(n, 640), np.full(n, 480), np.full(n, len(d)), np.tile(rows, (n, 1)))
        return Answers(batch, tickets([0] * n, list(range(n)), 1.0, 1.0, 1.0))


def requests(image: bytes) -> dict[str, tuple[str, dict[str, str], bytes]]:
    multipart = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="img.jpg"\r\n'
                 "Content-Type: image/jpeg\r\n\r\n").encode() + image + f"\r\n--{BOUNDARY}--\r\n".encode()
    tensor = join_bytes_tensor([image])
    header = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(tensor)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    return {
        "v1_detect_multipart": ("/v1/detect", {"content-type": f"multipart/form-data; boundary={BOUNDARY}",
                                               "content-length": str(len(multipart))}, multipart),
        "v2_infer_binary": ("/v2/models/yolopipe/infer", {
            "content-type": "application/octet-stream", "content-length": str(len(header) + len(tensor)),
            "inference-header-content-length": str(len(header))}, header + tensor),
    }


async def call(app, path: str, headers: dict[str, str], body: bytes) -> int:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    delivered = False
    status = 0

    async def receive() -> dict:
        nonlocal delivered
        if delivered:
            await asyncio.Event().wait()  # the body was all there was
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def measure(image: bytes, detections: int, rounds: int, per_round: int) -> dict:
    rng = np.random.default_rng(0)
    canned = Detections(rng.uniform(0, 480, (detections, 4)).astype(np.float32),
                        rng.uniform(0.25, 1, detections).astype(np.float32),
                        rng.integers(0, 2, detections).astype(np.int32))
    cases = requests(image)
    times: dict[str, list[float]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory(prefix="yolopipe-oip-overhead-") as run_folder:
        inference = CannedInference(canned, Path(run_folder))
        app = create_app(Settings(), inference)  # type: ignore[arg-type]
        app.state.inference = inference  # no lifespan: nothing to start
        for path, headers, body in cases.values():
            assert await call(app, path, headers, body) == 200
        for _ in range(rounds):
            for name, (path, headers, body) in cases.items():
                start = time.process_time()
                for _ in range(per_round):
                    await call(app, path, headers, body)
                times[name].append((time.process_time() - start) / per_round * 1e6)
    rows = {name: {"cpu_us_per_request": round(statistics.median(t), 1), "rounds_us": [round(x, 1) for x in t]}
            for name, t in times.items()}
    v1, v2 = (rows[n]["cpu_us_per_request"] for n in cases)
    return {"detections_per_image": detections, "rows": rows, "v2_over_v1_cpu": round(v2 / v1, 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", type=Path, default=None, help="a JPEG (default: a 640x480 crop of Ultralytics' bus.jpg)")
    p.add_argument("--detections", default="5,100", help="detections per answer, one row each")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--per-round", type=int, default=500)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.image is None:
        import importlib.util

        import cv2

        bus = cv2.imread(str(Path(importlib.util.find_spec("ultralytics").origin).parent / "assets" / "bus.jpg"))
        image = cv2.imencode(".jpg", cv2.resize(bus[:608], (640, 480)), [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()
    else:
        image = args.image.read_bytes()
    result = {"benchmark": "oip_overhead", "when": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine_info(), "versions": versions(), "image_bytes": len(image),
              "config": {"rounds": args.rounds, "per_round": args.per_round},
              "results": [asyncio.run(measure(image, int(n), args.rounds, args.per_round))
                          for n in args.detections.split(",")]}
    for r in result["results"]:
        print(f"{r['detections_per_image']} detections: " + ", ".join(
            f"{name} {row['cpu_us_per_request']} us" for name, row in r["rows"].items()) + f"; v2/v1 {r['v2_over_v1_cpu']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
