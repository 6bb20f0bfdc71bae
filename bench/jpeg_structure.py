"""What walking a JPEG's byte structure costs per image (``app.imaging.jpeg_structure``, run by
``read_header`` on every request path), beside the header parse alone and OpenCV's decode of
the same bytes.

Times are CPU time of this process (``time.process_time``), the best of several rounds: on a
shared machine wall time mostly measures the neighbours. Inputs: Ultralytics' bus.jpg and
zidane.jpg, and bus re-encoded at 1024 x 1365, quality 65 (about 235 KB: baseline, progressive, restart
intervals every 4 MCUs).

    python bench/jpeg_structure.py [--out bench/results/<date>-cpu-jpeg-structure.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import cv2
import numpy as np

from app.benchmark.machine import machine_info, versions

ROOT = Path(__file__).resolve().parents[1]


def inputs() -> dict[str, bytes]:
    import ultralytics

    assets = Path(ultralytics.__file__).parent / "assets"
    bus = (assets / "bus.jpg").read_bytes()
    big = cv2.resize(cv2.imdecode(np.frombuffer(bus, np.uint8), cv2.IMREAD_COLOR), (1024, 1365),
                     interpolation=cv2.INTER_CUBIC)

    def enc(*params: int) -> bytes:
        return cv2.imencode(".jpg", big, [cv2.IMWRITE_JPEG_QUALITY, 65, *params])[1].tobytes()

    return {"bus.jpg": bus, "zidane.jpg": (assets / "zidane.jpg").read_bytes(), "photo_1024x1365_baseline": enc(),
            "photo_1024x1365_progressive": enc(cv2.IMWRITE_JPEG_PROGRESSIVE, 1),
            "photo_1024x1365_restart_4": enc(cv2.IMWRITE_JPEG_RST_INTERVAL, 4)}


def cpu_us(fn, calls: int, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls)
    return round(best * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / f"{dt.date.today()}-cpu-jpeg-structure.json")
    args = parser.parse_args()
    from app.imaging.jpeg_structure import walk_jpeg

    rows = []
    for name, data in inputs().items():
        assert walk_jpeg(data).defect is None, name
        walk = cpu_us(lambda d=data: walk_jpeg(d), 200)
        scan = cpu_us(lambda d=data: d.count(b"\xff"), 200)
        decode = cpu_us(lambda d=data: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR), 10)
        rows.append({"input": name, "file_bytes": len(data), "walk_us": walk, "bytes_count_ff_us": scan,
                     "opencv_decode_us": decode, "walk_pct_of_decode": round(100 * walk / decode, 2)})
        print(json.dumps(rows[-1]), flush=True)
    record = {"what": "CPU time per image of the JPEG structure walk, of one bytes.count pass over the same "
                      "bytes (a memory-speed reference) and of OpenCV's decode; best of 7 rounds",
              "machine": machine_info(), "versions": versions(), "rows": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
