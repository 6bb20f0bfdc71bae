"""How long a user waits: whole processes, started and timed from outside, as a user types them.

Every row is one process (or, for the warm row, one process's second pass):

* ``predict``: ``yolopipe predict FOLDER --verbose``, artifacts present (an untimed run builds
  them first): ``wall_s`` (process start to exit) and ``first_result_s`` (process start to the
  first JSON line in ``--out``), its start-up steps (``--verbose``), CPU seconds, and the GPU
  libraries it imported;
* ``ultralytics``: Ultralytics on the same folder in the same run, from a fresh process:
  ``YOLO(weights).predict(folder, stream=True)`` writing one JSON line per image (streamed, so
  10,000 results are never held), interleaved round by round with ``predict``;
* ``serve``: ``yolopipe serve`` to the first 200 of ``/readyz`` (``ready_s``, with the 200's
  start-up steps) and of a ``/v1/detect`` (``first_detect_s``), artifacts present, after one
  untimed start (as ``--baseline``'s rows after one untimed run): a user's second start, with what
  the command alone imports kept as bytecode where the interpreter keeps none (``app.bytecode``);
* ``fresh-predict``, ``fresh-serve``: the first ``predict`` (of ``--fresh-images``) and the first
  ``serve`` with an empty artifacts folder and empty compiler caches (what a fresh machine does:
  export, build the engine, ...);
* ``warm``: ``predict_folder`` inside one process after one untimed pass (model open, engine
  loaded, graphs captured): the folder loop alone, what ``yolopipe bench``'s folder row times;
* ``bare`` (GPU): the engine predict runs, alone at ``--batch`` in a CUDA graph of its own: the
  rate predict's images after its first result (``yolopipe_after_first_img_per_s``: the images
  after the first batch over the time from the first JSON line to the exit) is compared with,
  and so is the loop's own rate (``yolopipe_first_to_last_img_per_s``: the same images over the
  time from the first JSON line to the last write; ``yolopipe_after_last_result_s``: the close
  and exit after it).

On a machine without a GPU the same rows run on ONNX Runtime (``--source samples``: the two
example photos, ``yolopipe predict samples``).

    python bench/startup.py --images .data/images --copies 10000 --out bench/results/DATE-MACHINE-startup.json
    python bench/startup.py --source samples --out bench/results/DATE-cpu-2core-startup.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import code_revision, machine_info, versions

GPU_MODULES = ("torch.cuda", "numba.cuda", "cupy", "tensorrt", "nvidia.nvimgcodec")
STEP = re.compile(r"^\s+(\d+\.\d+) s  (.+)$")
# `yolopipe ARGS...` in this interpreter, writing at exit the GPU libraries it had imported.
CLI_WITH_IMPORTS = """
import atexit, json, sys
out, sys.argv = sys.argv[1], ["yolopipe", *sys.argv[2:]]
roots = {roots!r}
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(
    m for m in sys.modules if any(m == r or m.startswith(r + ".") for r in roots)))))
from app.cli import main
main()
"""


def gpu_present() -> bool:
    from app.gpu.probe import cuda_device_count

    return cuda_device_count() > 0


# --- one process, timed from outside ----------------------------------------------------------
def timed(cmd: list[str], *, env: dict, log: Path, out: Path | None, timeout: float, cwd: Path = ROOT) -> dict:
    """Run ``cmd``: wall seconds to exit, seconds to the first line in ``out`` and to its last
    growth (the last results written: what follows is the command's close and exit), its CPU
    seconds. ``out`` is looked at every 5 ms, so both times are late by at most that."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("w") as fh:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        first = last = None
        size = 0
        while proc.poll() is None:
            now = time.monotonic() - started
            if out is not None:
                grown = _size(out)
                if grown != size:
                    size, last = grown, now
                if first is None and grown and _has_a_line(out):
                    first = now
            if now > timeout:
                proc.kill()
            time.sleep(0.005)
        wall = time.monotonic() - started
    if out is not None and _size(out) != size:  # written after the last look
        last = wall
    if first is None and out is not None and _has_a_line(out):
        first = wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = {"wall_s": round(wall, 3), "first_result_s": None if first is None else round(first, 3),
           "cpu_s": round(cpu, 2), "exit_code": proc.returncode}
    if out is not None:
        row["last_result_s"] = None if last is None else round(last, 3)
    return row


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _has_a_line(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return b"\n" in fh.read(1 << 16)
    except OSError:
        return False


def predict_row(source: str, batch: int, env: dict, scratch: Path, timeout: float, tag: str,
                verbose: bool = True, tree: Path = ROOT, decode: str = "") -> dict:
    out, modules, log = scratch / f"{tag}.jsonl", scratch / f"{tag}-modules.json", scratch / f"{tag}.log"
    out.unlink(missing_ok=True)
    code = CLI_WITH_IMPORTS.format(roots=("torch", "numba", "cupy", "tensorrt", "nvidia", "ultralytics"))
    cmd = [sys.executable, "-c", code, str(modules), "predict", source, "--out", str(out), "--batch", str(batch),
           *(["--verbose"] if verbose else []), *(["--decode", decode] if decode else [])]
    r = timed(cmd, env=env, log=log, out=out, timeout=timeout, cwd=tree)  # python -c imports from its folder
    text = log.read_text(errors="replace")
    loaded = json.loads(modules.read_text()) if modules.exists() else []
    r.update(images=_lines(out), startup_steps=[{"step": m[2], "s": float(m[1])} for m in map(STEP.match, text.splitlines()) if m],
             gpu_modules_loaded=sorted({m for m in loaded if any(m == g or m.startswith(g + ".") for g in GPU_MODULES)}),
             torch_imported="torch" in loaded, ultralytics_imported="ultralytics" in loaded)
    if r["exit_code"] != 0:
        r["log_tail"] = text[-2000:]
    return r


def _lines(path: Path) -> int:
    return sum(1 for _ in path.open()) if path.exists() else 0


# --- Ultralytics in a fresh process (a child of this script) ----------------------------------
def ultralytics_child(args: argparse.Namespace) -> None:
    """One JSON line per image as results stream out of ``YOLO.predict``; flushed after the first
    line (so its time is seen) and then once per batch, as yolopipe flushes."""
    os.environ.update(YOLO_OFFLINE="1", YOLO_VERBOSE="False")
    from ultralytics import YOLO

    model = YOLO(args.weights)
    gpu = args.device != "cpu"
    with open(args.out, "w") as fh:
        for i, r in enumerate(model.predict(args.source, stream=True, batch=args.batch, imgsz=args.imgsz,
                                            half=gpu, device=args.device, verbose=False), 1):
            b = r.boxes
            fh.write(json.dumps({"image": Path(r.path).name, "boxes": b.xyxy.tolist(), "scores": b.conf.tolist(),
                                 "classes": b.cls.tolist()}) + "\n")
            if i == 1 or i % args.batch == 0:
                fh.flush()


def ultralytics_row(source: str, weights: str, batch: int, env: dict, scratch: Path, timeout: float, tag: str) -> dict:
    out, log = scratch / f"{tag}.jsonl", scratch / f"{tag}.log"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "ultralytics", "--weights", weights,
           "--source", source, "--out", str(out), "--batch", str(batch), "--device", "0" if gpu_present() else "cpu"]
    r = timed(cmd, env=env, log=log, out=out, timeout=timeout)
    r["images"] = _lines(out)
    if r["exit_code"] != 0:
        r["log_tail"] = log.read_text(errors="replace")[-2000:]
    return r


# --- serve to ready ----------------------------------------------------------------------------
def serve_row(env: dict, scratch: Path, timeout: float, tag: str) -> dict:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = scratch / f"{tag}.log"
    phases: list[str] = []
    ready_s = detect_s = body = None
    with log.open("w") as fh:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            while time.monotonic() - started < timeout and proc.poll() is None:
                try:
                    r = http.get("/readyz")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                if r.status_code == 200:
                    ready_s, body = time.monotonic() - started, r.json()
                    break
                message = r.json()["error"]["message"]
                if not phases or phases[-1] != message:
                    phases.append(message)
                time.sleep(0.02)
            if ready_s is not None:
                r = http.post("/v1/detect", content=_jpeg(), headers={"content-type": "image/jpeg"}, timeout=120)
                detect_s = time.monotonic() - started if r.status_code == 200 else None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    row = {"ready_s": None if ready_s is None else round(ready_s, 3),
           "first_detect_s": None if detect_s is None else round(detect_s, 3),
           "readyz_startup": (body or {}).get("startup"), "readyz_503_phases": phases, "exit_code": proc.returncode}
    if ready_s is None:
        row["log_tail"] = log.read_text(errors="replace")[-2000:]
    return row


def _jpeg() -> bytes:
    import cv2
    import numpy as np

    y, x = np.mgrid[0:480, 0:640]
    image = np.stack([x * 255 // 640, y * 255 // 480, (x + y) * 127 // 1120], -1).astype(np.uint8)
    return cv2.imencode(".jpg", image)[1].tobytes()


# --- the warm loop, in one process ------------------------------------------------------------
def warm_child(args: argparse.Namespace) -> None:
    from app.contracts import RunShape
    from app.heap import keep_freed_heap
    from app.predict.folder import predict_folder
    from app.runtime import OpenOptions, ensure_artifacts, open_model_dir

    keep_freed_heap()
    options = OpenOptions(args.weights, pad_to_captured=True, shape=RunShape(max_batch=args.batch))
    with open_model_dir(ensure_artifacts(options), options) as detector:
        params = detector.params()
        predict_folder(detector, args.source, Path(args.out), params)  # untimed: opens everything
        started = time.perf_counter()
        summary = predict_folder(detector, args.source, Path(args.out), params)
        seconds = time.perf_counter() - started
        print(json.dumps({"wall_s": round(seconds, 3), "images": summary.images,
                          "img_per_s": round(summary.images / seconds, 1), "backend": detector.backend,
                          "precision": detector.precision}))


def child_json(child: str, more: list[str], env: dict, log: Path, timeout: float) -> tuple[dict | None, dict]:
    """This script as ``--child CHILD`` in a process of its own, timed: the JSON line it printed
    last (None if none) and the process's own row (``timed``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", child, *more]
    r = timed(cmd, env=env, log=log, out=None, timeout=timeout)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), r


def warm_row(source: str, weights: str, batch: int, env: dict, scratch: Path, timeout: float) -> dict:
    log = scratch / "warm.log"
    found, r = child_json("warm", ["--weights", weights, "--source", source, "--out", str(scratch / "warm.jsonl"),
                                   "--batch", str(batch)], env, log, timeout)
    return {**found, "process_wall_s": r["wall_s"]} if found else {**r, "log_tail": log.read_text()[-2000:]}


def baseline_tree(baseline: str, scratch: Path) -> tuple[Path, str]:
    """A folder holding the baseline's ``app/``, and the revision it is: ``baseline`` itself when it
    holds one (the GPU machine's copy has no git history; its ``REVISION`` file names it), else
    that git revision's ``app/`` archived into ``scratch``."""
    folder = Path(baseline)
    if (folder / "app").is_dir():
        stamp = folder / "REVISION"
        return folder.resolve(), stamp.read_text().strip() if stamp.exists() else folder.name
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", baseline], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = scratch / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "app"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree, rev


# --- the engine alone, in one process ----------------------------------------------------------
def bare_child(args: argparse.Namespace) -> None:
    """The default engine alone at ``--batch`` (``Detector.diagnose(bare=...)``: a CUDA graph of its
    own, the device held alone): the median device time of 50 replays after 10."""
    import numpy as np

    from app.contracts import RunShape
    from app.runtime import OpenOptions, ensure_artifacts, open_model_dir

    def measure(call):
        for _ in range(10):
            call()
        times = []
        for _ in range(50):
            started = time.perf_counter()
            call()
            times.append((time.perf_counter() - started) * 1e3)
        return times

    options = OpenOptions(args.weights, shape=RunShape(max_batch=args.batch))
    with open_model_dir(ensure_artifacts(options), options) as detector:
        batch = np.random.default_rng(0).random((args.batch, 3, args.imgsz, args.imgsz), dtype=np.float32)
        found = detector.diagnose(bare=batch, measure=measure)
        ms = statistics.median(found.bare.device_ms or found.bare.times_ms)
        print(json.dumps({"device_ms": round(ms, 3), "img_per_s": round(args.batch / ms * 1e3, 1),
                          "backend": detector.backend, "precision": detector.precision,
                          "batch_invariant": found.batch_invariant}))


def bare_row(weights: str, batch: int, env: dict, scratch: Path, timeout: float) -> dict:
    log = scratch / "bare.log"
    found, r = child_json("bare", ["--weights", weights, "--batch", str(batch)], env, log, timeout)
    return found if found else {**r, "log_tail": log.read_text()[-2000:]}


# --- the run -------------------------------------------------------------------------------------
def make_folder(images: Path, copies: int, dest: Path) -> str:
    """``copies`` files copied round-robin from ``images`` (real copies: no file shares an inode)."""
    photos = sorted(p for p in images.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    dest.mkdir(parents=True)
    for i in range(copies):
        src = photos[i % len(photos)]
        shutil.copyfile(src, dest / f"{i:06d}{src.suffix.lower()}")
    return str(dest)


def fresh_env(env: dict, scratch: Path, tag: str) -> dict:
    """An empty artifacts folder and empty compiler caches (inductor's go under the model's folder)."""
    base = scratch / f"fresh-{tag}"
    base.mkdir()
    out = {**env, "YOLOPIPE_ARTIFACTS_DIR": str(base / "artifacts"), "TRITON_CACHE_DIR": str(base / "triton"),
           "CUDA_CACHE_PATH": str(base / "nv"), "NUMBA_CACHE_DIR": str(base / "numba")}
    out.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return out


def summarize(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None and r.get("exit_code", 0) == 0]
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, help="a folder of photos to copy --copies times (the timed folder)")
    p.add_argument("--copies", type=int, default=10000)
    p.add_argument("--source", help="a folder, or 'samples' [default: the copies of --images]")
    p.add_argument("--fresh-images", type=int, default=256, help="images of the folder the fresh runs take")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="predict and ultralytics, interleaved")
    p.add_argument("--parts", default="predict,ultralytics,serve,warm,bare,fresh-predict,fresh-serve")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one process may take")
    p.add_argument("--out", type=Path)
    p.add_argument("--note", default="")
    p.add_argument("--decodes", default="", help="predict's rows once per --decode named (comma-separated; the first "
                   "is the summary's), interleaved [default: predict's own]")
    p.add_argument("--baseline", help="a git revision whose `yolopipe predict` runs the same way, interleaved, or a "
                   "folder holding that revision's app/ (and a REVISION file naming it), where there is no git")
    # child processes of this script
    p.add_argument("--child", choices=("ultralytics", "warm", "bare"), help=argparse.SUPPRESS)
    p.add_argument("--weights", default="sample", help=argparse.SUPPRESS)
    p.add_argument("--device", default="0", help=argparse.SUPPRESS)
    p.add_argument("--imgsz", type=int, default=640, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "ultralytics":
        return ultralytics_child(args)
    if args.child == "warm":
        return warm_child(args)
    if args.child == "bare":
        return bare_child(args)

    from app.weights import resolve_weights

    parts = set(args.parts.split(","))
    weights = str(resolve_weights("sample").path)
    scratch = Path(tempfile.mkdtemp(prefix="yolopipe-startup-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "YOLO_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    rows: list[dict] = []
    gpu = gpu_present()
    try:
        if args.source:
            source = args.source
        elif args.images:
            source = make_folder(args.images, args.copies, scratch / "folder")
        else:
            p.error("give --images (copied --copies times) or --source")
        count = None if source == "samples" else sum(1 for _ in Path(source).iterdir())
        from app.cli.predict import resolve_source

        their_source = resolve_source(source)  # 'samples': Ultralytics' own example images
        common = {"input": "folder" if source != "samples" else "samples", "batch": args.batch}

        def add(row: dict) -> None:
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("startup_steps", "readyz_startup")}),
                  file=sys.stderr, flush=True)

        baseline_env = None
        if args.baseline and "predict" in parts:
            tree, rev = baseline_tree(args.baseline, scratch)
            baseline_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}

        def baseline_row(tag: str) -> dict:  # the baseline's predict, run as ours is
            return predict_row(source, args.batch, baseline_env, scratch, args.timeout, tag, verbose=False, tree=tree)
        if {"predict", "serve", "warm"} & parts:  # artifacts present: one untimed run builds what is missing
            prep = predict_row(source, args.batch, env, scratch, args.timeout, "untimed-build")
            add({"system": "yolopipe", "mode": "cli", "untimed": "builds the artifacts the timed runs find", **prep})
        # Each command timed runs once untimed first, as a user's second run: what it alone imports
        # (serve's web stack) has its bytecode kept where the interpreter keeps none (app.bytecode).
        if baseline_env is not None:
            add({"system": f"yolopipe {rev} (baseline)", "mode": "cli", "untimed": "its first run",
                 **baseline_row("base-untimed")})
        if "serve" in parts:
            add({"system": "yolopipe", "part": "ready", "untimed": "its first start",
                 **serve_row(env, scratch, args.timeout, "serve-untimed")})
        for i in range(args.rounds if {"predict", "ultralytics"} & parts else 0):
            if baseline_env is not None:
                add({"system": f"yolopipe {rev} (baseline)", "mode": "cli", **common, "images": count,
                     "artifacts": "present", "round": i + 1, **baseline_row(f"base-{i}")})
            for decode in args.decodes.split(",") if "predict" in parts else ():
                add({"system": "yolopipe", "mode": "cli", **common, "images": count, "artifacts": "present",
                     "round": i + 1, "decode": decode or "default",
                     **predict_row(source, args.batch, env, scratch, args.timeout, f"predict-{i}{decode}", decode=decode)})
            if "ultralytics" in parts:
                add({"system": "ultralytics", "mode": "python: YOLO.predict(stream=True), fresh process", **common,
                     "images": count, "round": i + 1,
                     **ultralytics_row(their_source, weights, args.batch, env, scratch, args.timeout, f"ultra-{i}")})
        if "serve" in parts:
            for i in range(args.rounds):
                add({"system": "yolopipe", "part": "ready", "artifacts": "present", "round": i + 1,
                     "standby": os.environ.get("YOLOPIPE_STANDBY", "true"), **serve_row(env, scratch, args.timeout, f"serve-{i}")})
        if "warm" in parts:
            add({"system": "yolopipe", "mode": "in-process", **common, "artifacts": "present",
                 "what": "predict_folder in one process after one untimed pass (model open, engine loaded, graphs "
                         "captured): reading, decoding, detecting and writing JSON only, no start-up",
                 **warm_row(their_source, "sample", args.batch, env, scratch, args.timeout)})
        if "bare" in parts and gpu:
            add({"system": "yolopipe", "part": "bare", "batch": args.batch,
                 "what": "the engine predict runs, alone at predict's batch: the rate 'after the first result' is held to",
                 **bare_row("sample", args.batch, env, scratch, args.timeout)})
        if "fresh-predict" in parts:
            small = source
            if source != "samples" and count and count > args.fresh_images:
                small = str(scratch / "fresh-folder")
                Path(small).mkdir()
                for f in sorted(Path(source).iterdir())[: args.fresh_images]:
                    os.link(f, Path(small) / f.name)
            add({"system": "yolopipe", "mode": "cli", **common, "images": min(count or 2, args.fresh_images),
                 "artifacts": "fresh", **predict_row(small, args.batch, fresh_env(env, scratch, "predict"), scratch,
                                                     args.timeout, "fresh-predict")})
        if "fresh-serve" in parts:
            add({"system": "yolopipe", "part": "ready", "artifacts": "fresh",
                 **serve_row(fresh_env(env, scratch, "serve"), scratch, args.timeout, "fresh-serve")})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def pick(**match):
        return [r for r in rows if all(r.get(k) == v for k, v in match.items()) and "untimed" not in r]

    ours = pick(system="yolopipe", mode="cli", artifacts="present", decode=args.decodes.split(",")[0] or "default")
    theirs = pick(system="ultralytics")
    summary = {"yolopipe_wall_s": summarize(ours, "wall_s"), "yolopipe_first_result_s": summarize(ours, "first_result_s"),
               "ultralytics_wall_s": summarize(theirs, "wall_s"),
               "ultralytics_first_result_s": summarize(theirs, "first_result_s"),
               "serve_ready_s": summarize(pick(part="ready", artifacts="present"), "ready_s")}
    def after_first(end: str, among: list[dict] = ours) -> list[float]:
        """Per finished row, the images after the first batch over the time from its JSON line to ``end``."""
        return [(r["images"] - args.batch) / (r[end] - r["first_result_s"]) for r in among
                if r.get("exit_code") == 0 and (r.get("images") or 0) > args.batch and r.get("first_result_s")
                and r.get(end) and r[end] > r["first_result_s"]]

    after = after_first("wall_s")
    if after:  # the images after the first batch, over the time from its JSON line to the exit
        summary["yolopipe_after_first_img_per_s"] = round(statistics.median(after), 1)
    # the same images over the time from the first JSON line to the last: the folder loop alone,
    # without the close and exit that follow it (``yolopipe_after_last_result_s``)
    between = after_first("last_result_s")
    if between:
        summary["yolopipe_first_to_last_img_per_s"] = round(statistics.median(between), 1)
        summary["yolopipe_after_last_result_s"] = round(statistics.median(
            r["wall_s"] - r["last_result_s"] for r in ours if r.get("exit_code") == 0 and r.get("last_result_s")), 3)
    bare = pick(part="bare")
    if after and bare and bare[0].get("img_per_s"):
        summary["bare_img_per_s"] = bare[0]["img_per_s"]
        summary["after_first_over_bare"] = round(summary["yolopipe_after_first_img_per_s"] / bare[0]["img_per_s"], 2)
        if between:
            summary["first_to_last_over_bare"] = round(summary["yolopipe_first_to_last_img_per_s"] / bare[0]["img_per_s"], 2)
    if baseline_env is not None:
        base = [r for r in rows if r.get("system", "").endswith("(baseline)") and "untimed" not in r]
        summary.update(baseline_wall_s=summarize(base, "wall_s"), baseline_first_result_s=summarize(base, "first_result_s"),
                       baseline_cpu_s=summarize(base, "cpu_s"), yolopipe_cpu_s=summarize(ours, "cpu_s"))
        base_between = after_first("last_result_s", base)
        if base_between:
            summary["baseline_first_to_last_img_per_s"] = round(statistics.median(base_between), 1)
    if summary["yolopipe_wall_s"] and summary["ultralytics_wall_s"]:
        summary["ultralytics_over_yolopipe_wall"] = round(summary["ultralytics_wall_s"] / summary["yolopipe_wall_s"], 2)
    out = {
        "what": "bench/startup.py: whole processes timed from outside (see its docstring); medians in summary",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine_info(gpu=gpu), "nproc": os.cpu_count(), "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
                    "note": args.note},
        "versions": versions(),
        "code": code_revision() or "unknown (no git here)",
        "config": {"source": "samples" if source == "samples" else f"{count} files", "batch": args.batch,
                   "rounds": args.rounds, "parts": sorted(parts), "gpu": gpu},
        "summary": summary,
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
