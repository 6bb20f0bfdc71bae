"""How long ``yolopipe serve`` takes to be ready: a first start, then restarts with artifacts present.

Each start is a fresh ``yolopipe serve`` process (``--backend``, default onnxruntime, so it runs
on any machine; ``--backend auto`` on a GPU host). Reported per start: seconds from the
process start to the first 200 of ``/readyz`` and of ``/v1/detect`` (a 640×480 JPEG), and the
start-up steps ``/readyz``'s 503 body named meanwhile, in order (what an operator sees). The
first start uses an empty artifacts folder (it exports the model; on a GPU it also builds or
compiles), the next ones the artifacts it left: the restart that must be ready in ≤ 30 s.
``--baseline REV`` runs that git revision's server the same way, interleaved start by start.

    python bench/serve_ready.py --baseline main --restarts 3 --out bench/results/<date>-<machine>-serve-ready.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import machine_info, versions  # noqa: E402
from bench.server_meter import free_port  # noqa: E402


def _jpeg() -> bytes:
    import cv2
    import numpy as np

    y, x = np.mgrid[0:480, 0:640]
    image = np.stack([x * 255 // 640, y * 255 // 480, (x + y) * 127 // 1120], -1).astype(np.uint8)
    return cv2.imencode(".jpg", image)[1].tobytes()


def one_start(tree: Path, artifacts: Path, backend: str, log: Path, timeout_s: float) -> dict:
    """One ``yolopipe serve`` of the code in ``tree``, from its start to its first answers, then SIGTERM."""
    import httpx

    port = free_port()
    env = {**os.environ, "YOLOPIPE_ARTIFACTS_DIR": str(artifacts), "YOLO_OFFLINE": "1", "PYTHONPATH": str(tree)}
    base = f"http://127.0.0.1:{port}"
    image = _jpeg()
    steps: list[str] = []
    ready_s = detect_s = None
    with log.open("w") as out:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--backend", backend, "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tree)
    try:
        with httpx.Client(base_url=base, timeout=5) as http:
            while time.monotonic() - started < timeout_s and proc.poll() is None:
                try:
                    r = http.get("/readyz")
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                if r.status_code == 200:
                    ready_s = time.monotonic() - started
                    break
                message = r.json()["error"]["message"]
                if not steps or steps[-1] != message:
                    steps.append(message)
                time.sleep(0.05)
            if ready_s is not None:
                r = http.post("/v1/detect", content=image, headers={"content-type": "image/jpeg"}, timeout=60)
                if r.status_code == 200:
                    detect_s = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    lines = [line.split(": ", 1)[-1] for line in log.read_text().splitlines() if "inference worker 0" in line]
    return {"ready_s": None if ready_s is None else round(ready_s, 2),
            "first_detect_s": None if detect_s is None else round(detect_s, 2), "exit_code": proc.returncode,
            "readyz_steps": steps, "log_steps": lines}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="onnxruntime")
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--baseline", help="a git revision measured the same way, interleaved")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    p.add_argument("--out")
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="yolopipe-ready-"))
    variants = {"this": ROOT}
    try:
        if args.baseline:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], check=True,
                                 capture_output=True, text=True).stdout.strip()
            tree = scratch / "baseline"
            tree.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "app"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
            variants = {f"baseline {rev}": tree, "this": ROOT}
        results: dict[str, dict] = {name: {"first_start": None, "restarts": []} for name in variants}
        artifacts = {name: scratch / f"artifacts-{k}" for k, name in enumerate(variants)}  # each its own, empty at first
        for name, tree in variants.items():
            first = one_start(tree, artifacts[name], args.backend, scratch / "first.log", args.timeout)
            results[name]["first_start"] = first
            print(f"{name} first start: {first}", file=sys.stderr, flush=True)
        for i in range(args.restarts):
            for name, tree in variants.items():
                r = one_start(tree, artifacts[name], args.backend, scratch / "restart.log", args.timeout)
                results[name]["restarts"].append(r)
                print(f"{name} restart {i + 1}: {r}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for result in results.values():
        ready = [r["ready_s"] for r in result["restarts"] if r["ready_s"] is not None]
        result["restart_ready_s_median"] = round(statistics.median(ready), 2) if ready else None
        result["restart_ready_le_30s"] = bool(ready) and len(ready) == len(result["restarts"]) and max(ready) <= 30.0
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    out = {
        "benchmark": "serve_ready",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine_info(), "nproc": os.cpu_count(), "note": "shared with other jobs"},
        "versions": versions(),
        "commit": commit,
        "backend": args.backend,
        **results,
    }
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
