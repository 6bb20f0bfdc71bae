"""The build rows on the GPU machine (suite.sh's ``builds`` part): ``yolopipe build-engine`` of the
default engine (torch-cuda, fp16, batch-invariant) timed as a user runs it, each in a folder of
its own with fresh inductor and Triton caches:

1. ``none``: no tuning cache, into yolopipe's default artifacts folder (a first build on a fresh
   machine; what the tests and benchmarks then load);
2. ``hit``: from the tuning cache the first build wrote, into a fresh artifacts folder;
3. with ``--cudnn``: the cuDNN package (``--no-batch-invariant``, not tuned), the baseline.

Writes ``OUT/build-times.json`` (machine, versions, commit, rows) and the cache the first build
wrote as ``OUT/tuning-<card>.json`` (commit it under ``bench/tuning/``). Each build's output is in
``OUT/build-<row>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build(name: str, out: Path, work: Path, *args: str, artifacts: Path | None) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(work / name / "triton")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the build's own, under the model's folder
    command = [sys.executable, "-m", "app.cli", "build-engine", "--weights", "sample", *args]
    if artifacts is not None:
        command += ["--artifacts-dir", str(artifacts)]
    started = time.perf_counter()
    with open(out / f"build-{name}.log", "w") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, check=False).returncode
    wall = time.perf_counter() - started
    text = (out / f"build-{name}.log").read_text(errors="replace")
    print(f"{name}: rc={rc} {wall:.1f} s", flush=True)
    return {"rc": rc, "wall_s": round(wall, 1), "said": [line for line in text.splitlines() if line.strip()][-40:]}


def manifest(artifacts: Path, kernels: str) -> dict:
    found = sorted(artifacts.glob(f"*/imgsz640/torch-cuda/fp16.b1-64.{kernels}.json"))
    return json.loads(found[-1].read_text()) if found else {}


def main() -> int:
    from app.artifacts.store import artifacts_root
    from app.benchmark.machine import PACKAGES, machine_info, versions
    from app.gpu.probe import gpu_identity

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/builds"))
    parser.add_argument("--cudnn", action="store_true", help="also the cuDNN package, the baseline")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    card = gpu_identity(0)[0]
    cache = args.out / f"tuning-{card.lower().replace(' ', '-')}.json"
    cache.unlink(missing_ok=True)
    rows = []
    plan = [("none", "invariant", ["--tuning-cache", str(cache)], None),
            ("hit", "invariant", ["--tuning-cache", str(cache)], args.work / "hit" / "artifacts")]
    if args.cudnn:
        plan.append(("cudnn", "cudnn", ["--no-batch-invariant"], args.work / "cudnn" / "artifacts"))
    for name, kernels, more, artifacts in plan:
        if name == "hit" and not cache.is_file():
            break
        result = build(name, args.out, args.work, *more, artifacts=artifacts)
        built = manifest(artifacts or artifacts_root(), kernels)
        rows.append({"part": "build", "engine": f"torch-cuda fp16 b1-64 {kernels}", "card": card,
                     "tuning_cache": "hit" if name == "hit" else ("none" if kernels == "invariant" else "untuned"),
                     "wall_s": result["wall_s"], "rc": result["rc"], "build_seconds": built.get("build_seconds"),
                     "tuning": built.get("builder", {}).get("tuning"),
                     "tuning_cache_bytes": cache.stat().st_size if cache.is_file() and kernels == "invariant" else None,
                     "said": result["said"]})
        report = {"what": "yolopipe build-engine --weights sample, timed as users run it (issue 45, goal 2)",
                  "machine": machine_info(gpu=True), "versions": versions(PACKAGES),
                  "commit": os.environ.get("BENCH_COMMIT"), "rows": rows}
        (args.out / "build-times.json").write_text(json.dumps(report, indent=1) + "\n")  # after each row
        if result["rc"] != 0:
            break
    return 0 if rows and all(row["rc"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
