"""Peak memory and time of one image decode: OpenCV's ``imdecode`` alone vs yolopipe's
``decode_image`` (header first, then the same decode), and yolopipe's estimate.

Each row runs in a fresh subprocess (peak RSS is a high-water mark: VmHWM), one after
another, so rows compete for nothing but the machine's background load. Images are made here: real
7,000² photos-like images in every accepted format, and the hostile files of issue #10 (bombs
declared in a header), forged with ``tests/forge.py``.

    python bench/decode_memory.py [--out bench/results/<date>-cpu-decode-memory.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import cv2
import numpy as np

from app.benchmark.machine import machine_info, versions

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import sys, time, numpy as np, cv2
from app.imaging.decode import decode_image
from app.errors import YolopipeError

def peak():  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent through fork and exec
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

data = open(sys.argv[2], "rb").read()
base = peak()
start = time.perf_counter()
try:
    if sys.argv[1] == "opencv":
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        outcome = "decoded" if img is not None else "None"
    else:
        decode_image(data)
        outcome = "decoded"
except cv2.error:
    outcome = "cv2.error"
except YolopipeError as exc:
    outcome = type(exc).__name__
seconds = time.perf_counter() - start
print(seconds, peak() - base, outcome)
"""


def load_forge():
    spec = importlib.util.spec_from_file_location("forge", ROOT / "tests" / "forge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs() -> dict[str, tuple[bytes, bool]]:
    """name → (bytes, whether OpenCV alone may decode it here without hurting the machine)."""
    import ultralytics

    forge = load_forge()
    bus = (Path(ultralytics.__file__).parent / "assets" / "bus.jpg").read_bytes()
    side = 7_000
    photo = cv2.GaussianBlur(np.random.default_rng(0).integers(0, 256, (side, side, 3), np.uint8), (0, 0), 5)

    def enc(img: np.ndarray, ext: str, *params: int) -> bytes:
        return cv2.imencode(ext, img, params)[1].tobytes()

    return {
        "jpeg_baseline_7000": (enc(photo, ".jpg"), True),
        "jpeg_progressive_7000": (enc(photo, ".jpg", cv2.IMWRITE_JPEG_PROGRESSIVE, 1), True),
        "png_rgb_7000": (forge.png(side, side), True),
        "png_1bit_7071": (forge.png(7_071, 7_071, bits=1, color=0), True),
        "png_rgba_16bit_7000": (forge.png(side, side, bits=16, color=6), True),
        "bmp_rle8_7000": (forge.bmp_rle8(side, side), True),
        "webp_lossy_7000": (enc(photo, ".webp", cv2.IMWRITE_WEBP_QUALITY, 80), True),
        "tiff_lzw_8bit_7000": (enc(photo, ".tiff"), True),
        "tiff_lzw_16bit_7000": (enc(photo.astype(np.uint16) * 257, ".tiff"), True),
        "tiff_group4_7000": (forge.tiff_g4_white(side, side), True),
        "tiff_100px_in_a_16384x16000_tile": (forge.tiff(100, 100, tile=(16_384, 16_000), compression=8,
                                                        strip=zlib.compress(bytes(16_384 * 16_000 * 3), 9)), True),
        "bmp_rle8_20000": (forge.bmp_rle8(20_000, 20_000), True),
        "tiff_group4_20000": (forge.tiff_g4_white(20_000, 20_000), True),
        "bmp_rle8_30000": (forge.bmp_rle8(30_000, 30_000), False),
        "tiff_group4_30000": (forge.tiff_g4_white(30_000, 30_000), False),
        "jpeg_fill_byte_50000": (forge.jpeg_with_size(bus, 50_000, 50_000, fill=1), True),
        "jpeg_fill_byte_30000": (forge.jpeg_with_size(bus, 30_000, 30_000, fill=1), False),
        "webp_vp8l_16383": (forge.riff_webp(forge.vp8l(16_383, 16_383)), True),
    }


def run_row(system: str, path: Path) -> tuple[float, int, str]:
    out = subprocess.run([sys.executable, "-c", CHILD, system, str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, check=True)
    seconds, rss, outcome = out.stdout.split()[-3:]
    return float(seconds), int(rss), outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / f"{dt.date.today()}-cpu-decode-memory.json")
    args = parser.parse_args()
    from app.imaging.decode import decode_bytes
    from app.imaging.headers import read_header

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (data, opencv_too) in inputs().items():
            path = Path(tmp) / name
            path.write_bytes(data)
            header = read_header(data)
            for system in ("opencv", "yolopipe") if opencv_too else ("yolopipe",):
                seconds, rss, outcome = run_row(system, path)
                rows.append({"system": system, "input": name, "file_bytes": len(data), "pixels": header.pixels,
                             "estimate_mb": round(decode_bytes(header) / 1e6, 1), "peak_rss_delta_mb": round(rss / 1e6, 1),
                             "seconds": round(seconds, 3), "outcome": outcome})
                print(json.dumps(rows[-1]), flush=True)
    record = {"what": "peak RSS (VmHWM) and time of one decode, each row in a fresh subprocess, rows run one "
                      "after another; the memory is the point: times on a shared machine are indicative only",
              "machine": machine_info(), "versions": versions(), "rows": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
