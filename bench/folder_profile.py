"""``predict_folder`` on N copies of a folder's JPEGs, timed after a warm run; meant to run
under a sampling profiler (``py-spy record --gil``) to see what holds the GIL on the folder
path (issue #16).

    python3 bench/folder_profile.py --images DIR --count 10000 --batch 128 [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=Path, required=True)
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--precision", default="auto")
    a = ap.parse_args()

    from app.benchmark.workloads import make_folder
    from app.pipeline.folder import predict_folder
    from app.runtime import open_detector

    files = sorted(p for p in a.images.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    tmp = Path(tempfile.mkdtemp(prefix="yolopipe-folder-profile-"))
    try:
        folder = make_folder(tmp / "images", [(p.name, p.read_bytes()) for p in files], a.count)
        out = tmp / "out.jsonl"
        with open_detector("sample", backend=a.backend, precision=a.precision, max_batch=a.batch) as det:
            params = det.params()
            predict_folder(det, str(folder), out, params, batch=a.batch)  # warm: page cache, graphs
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                s = predict_folder(det, str(folder), out, params, batch=a.batch)
                wall = time.perf_counter() - t0
                print(json.dumps({"images": s.images, "errors": s.errors, "wall_s": round(wall, 3),
                                  "img_per_s": round(s.images / wall, 1)}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
