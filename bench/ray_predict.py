"""Folder inference on Ray Data vs plain ``yolopipe predict``, in one run, on the same JPEG folder.

    python bench/ray_predict.py [--count 20000] [--ray-gpus 1,2] [--weights sample|yolov8s.yaml] [--out FILE]
    python bench/ray_predict.py --smoke      # on a CPU: proves every row runs; not a benchmark

The script copies the photos of ``--images`` into a temporary folder until it holds
``--count`` JPEGs, builds the model's artifacts once, then measures, each in a fresh process
(so no GPU or Ray state carries over): plain ``predict_folder`` on one GPU (``system:
"yolopipe"``) and ``predict_with_ray`` with 1, 2, ... GPU actors (``"yolopipe-ray"``), all on
the same folder in the same run. Without a GPU (or with ``--smoke``) it is a smoke run: both
systems on ONNX Runtime on the CPU (``gpus: 0``), a small folder, ``"smoke": true`` in the
file, which goes to ``--out`` or the temp folder, never to ``bench/results``.

``--weights yolov8s.yaml`` (any Ultralytics model config): random weights of that architecture,
for cost-only runs where real weights cannot travel (the same layers, so the same speed;
detections are meaningless).

Rows: ``system``, ``input`` (``jpeg``), ``gpus``, ``images``, ``img_per_s`` (steady state:
images after the first written batch over the time since it, so model load, compilation,
Ray start-up and graph capture are not counted; they are in ``startup_s``), ``wall_s`` (the
whole call), ``errors``, ``backend``, ``batch``. ``goals`` holds the ratios issues 12 and 21 ask
for (two GPUs over one under Ray ≥ 1.9; one GPU under Ray over plain predict ≥ 0.90).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # `python bench/ray_predict.py`: make the repo importable
    sys.path.insert(0, str(REPO))

from app.benchmark.machine import PACKAGES, machine_info, versions

os.environ.setdefault("YOLO_OFFLINE", "1")
SHARED_IMAGES = REPO.parent / "shared" / "data" / "images"


def default_images() -> Path:
    """``$YOLOPIPE_IMAGES``, else the shared photos beside the checkout, else Ultralytics' assets."""
    if env := os.environ.get("YOLOPIPE_IMAGES"):
        return Path(env)
    if SHARED_IMAGES.is_dir():
        return SHARED_IMAGES
    import ultralytics

    return Path(ultralytics.__file__).parent / "assets"


# ------------------------------------------------------------------------------ set-up
def make_folder(images: Path, count: int, dest: Path) -> int:
    """``count`` JPEG files in ``dest``: copies of the photos in ``images``, round robin."""
    photos = sorted(p for p in images.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not photos:
        raise SystemExit(f"no JPEG images in {images}")
    for i in range(count):
        sub = dest / f"{i // 1000:03d}"  # 1,000 files a folder
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        src = photos[i % len(photos)]
        shutil.copyfile(src, sub / f"{i:06d}_{src.name}")
    return len(photos)


# ---------------------------------------------------------------------- one row, own process
class Clock:
    """``on_progress`` for both paths: when the first batch and the last one were written."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: tuple[float, int] | None = None
        self.done = 0
        self.end = self.start

    def __call__(self, n: int, total: int) -> None:
        if not n:
            return
        self.done += n
        self.end = time.perf_counter()
        if self.first is None:
            self.first = (self.end, self.done)

    def row(self) -> dict:
        assert self.first is not None, "nothing was written"
        t_first, n_first = self.first
        steady = (self.done - n_first) / (self.end - t_first) if self.end > t_first else float("nan")
        return {"images": self.done, "img_per_s": round(steady, 1), "wall_s": round(self.end - self.start, 2),
                "startup_s": round(t_first - self.start, 2)}


def run_row(spec: dict) -> dict:
    from app.contracts import RunShape
    from app.records import read_written
    from app.runtime import OpenOptions

    out = Path(spec["workdir"]) / f"out-{spec['system']}-{spec['gpus']}-{spec['rep']}.jsonl"
    options = OpenOptions(spec["weights"], backend=spec["backend"], precision=spec["precision"], imgsz=spec["imgsz"],
                          artifacts_dir=Path(spec["artifacts_dir"]), ort_threads=spec["ort_threads"] or 0,
                          shape=RunShape(max_batch=spec["batch"]))
    clock = Clock()
    if spec["system"] == "yolopipe":
        from app.predict.folder import predict_folder
        from app.runtime import ensure_artifacts, open_model_dir

        with open_model_dir(ensure_artifacts(options), options) as det:
            det.warmup()  # as the Ray actors do: every bucket's graph before the first batch
            summary = predict_folder(det, spec["folder"], out, det.params(), on_progress=clock)
            backend = det.backend
    else:
        from app.distributed import predict_with_ray

        summary = predict_with_ray(spec["folder"], out, options=options, gpu_actors=spec["gpus"],
                                   cpu_actors=spec["cpu_actors"], on_progress=clock)
        backend = spec["backend"]
    lines = out.read_text().splitlines()
    assert len(lines) == len(read_written(out).images) == summary.images, "an image is missing or written twice"
    return {"system": spec["system"], "input": "jpeg", "gpus": spec["gpus"], **clock.row(), "errors": summary.errors,
            "detections": summary.detections, "backend": backend, "precision": spec["precision"],
            "batch": spec["batch"], "imgsz": spec["imgsz"], "repeat": spec["rep"]}


# ------------------------------------------------------------------------------ the run
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, default=None, help="JPEGs to copy (default: see default_images)")
    p.add_argument("--count", type=int, default=None, help="JPEGs in the measured folder (default 20,000; smoke 96)")
    p.add_argument("--weights", default="sample", help="weights spec, or an Ultralytics model .yaml (random weights)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=None, help="images per detector call, both systems (default 64; smoke 8)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--ray-gpus", default=None, help="Ray rows: GPU actors, e.g. 1,2 (default: 1..all GPUs; 0 on a CPU)")
    p.add_argument("--smoke", action="store_true", help="CPU smoke run (implied without a GPU): not a benchmark")
    p.add_argument("--cpu-actors", type=int, default=1, help="ONNX Runtime actors when gpus is 0")
    p.add_argument("--ort-threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=1, help="rounds of all rows, interleaved")
    p.add_argument("--skip-plain", action="store_true", help="no plain predict row")
    p.add_argument("--row-timeout-s", type=int, default=900)
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed afterwards")
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process
    return p.parse_args(argv)


def gpu_count() -> int:
    from app.gpu.probe import cuda_device_count

    return cuda_device_count()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.row:
        print("ROW " + json.dumps(run_row(json.loads(args.row))), flush=True)
        return
    t0 = time.perf_counter()
    args.images = args.images or default_images()
    gpus = 0 if args.smoke else gpu_count()
    smoke = gpus == 0
    args.count = args.count or (96 if smoke else 20_000)
    args.batch = args.batch or (8 if smoke else 64)
    ray_gpus = [int(g) for g in args.ray_gpus.split(",")] if args.ray_gpus and not smoke else (
        list(range(1, gpus + 1)) or [0])
    backend = args.backend if gpus else "onnxruntime"
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="yolopipe-ray-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        folder = workdir / "images"
        log(f"copying {args.count} JPEGs from {args.images} into {folder}")
        photos = make_folder(args.images, args.count, folder)
        weights = args.weights
        from app.runtime import OpenOptions, export_model

        artifacts_dir = workdir / "artifacts"
        export_model(OpenOptions(weights, imgsz=args.imgsz, artifacts_dir=artifacts_dir))  # once, before every row
        log(f"artifacts in {artifacts_dir} ({time.perf_counter() - t0:.0f} s)")
        base = {"folder": str(folder), "workdir": str(workdir), "weights": weights, "backend": backend,
                "precision": args.precision, "imgsz": args.imgsz, "batch": args.batch,
                "artifacts_dir": str(artifacts_dir), "cpu_actors": args.cpu_actors, "ort_threads": args.ort_threads}
        plan = [] if args.skip_plain else [("yolopipe", min(gpus, 1))]
        plan += [("yolopipe-ray", g) for g in ray_gpus]
        rows, failures = [], []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        for rep in range(args.repeat):
            for system, g in plan:
                spec = {**base, "system": system, "gpus": g, "rep": rep}
                log(f"{system} gpus={g} round {rep + 1}/{args.repeat}")
                row, error = run_child(spec, env, args.row_timeout_s)
                if row:
                    rows.append(row)
                    log(f"  {row['img_per_s']} img/s steady, {row['wall_s']} s wall, {row['startup_s']} s start-up")
                else:
                    failures.append({"system": system, "gpus": g, "repeat": rep, "error": error})
                    log(f"  FAILED: {error}")
        from app.config import IN_FLIGHT
        from app.distributed.job import BATCHES_PER_BLOCK

        result = {
            "smoke": smoke,
            "machine": {**machine_info(), "gpu_count": gpus, "load_average": os.getloadavg()},
            "versions": versions((*PACKAGES, "ray", "pyarrow", "pandas")),
            "config": {"images_from": str(args.images), "distinct_photos": photos, "count": args.count,
                       "weights": args.weights, "imgsz": args.imgsz, "batch": args.batch, "backend": backend,
                       "precision": args.precision, "ray_gpus": ray_gpus, "cpu_actors": args.cpu_actors,
                       "ort_threads": args.ort_threads, "repeat": args.repeat,
                       "batches_per_block": BATCHES_PER_BLOCK, "in_flight_per_gpu_actor": IN_FLIGHT,
                       "date": dt.datetime.now().isoformat(timespec="seconds"),
                       "elapsed_s": round(time.perf_counter() - t0, 1)},
            "note": ("CPU smoke run: proves the rows run, not a benchmark. " if smoke else "") + args.note,
            "rows": rows,
            "goals": {} if smoke else goals(rows),  # a smoke run's rates mean nothing
            "failures": failures,
        }
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    results = Path(tempfile.gettempdir()) if smoke else REPO / "bench" / "results"
    out = args.out or results / f"{dt.date.today()}-{f'gpu{gpus}' if gpus else 'cpu-smoke'}-ray-predict.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["goals"], indent=2))
    log(f"wrote {out}")


def run_child(spec: dict, env: dict, timeout_s: int) -> tuple[dict | None, str | None]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("ROW "):
            return json.loads(line[4:]), None
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    return None, f"exit {proc.returncode}: " + " | ".join(tail)


def goals(rows: list[dict]) -> dict:
    """Issues 12 and 21's ratios from the best row of each kind (the goals: ≥ 1.9 and ≥ 0.90)."""
    best: dict[tuple[str, int], float] = {}
    for r in rows:
        key = (r["system"], r["gpus"])
        best[key] = max(best.get(key, 0.0), r["img_per_s"])
    out = {}
    one = best.get(("yolopipe-ray", 1))
    if one and best.get(("yolopipe-ray", 2)):
        out["ray_2_gpus_over_1_gpu"] = round(best[("yolopipe-ray", 2)] / one, 3)
    if one and best.get(("yolopipe", 1)):
        out["ray_1_gpu_over_plain_predict"] = round(one / best[("yolopipe", 1)], 3)
    if best.get(("yolopipe-ray", 0)) and best.get(("yolopipe", 0)):
        out["cpu_ray_over_plain_predict"] = round(best[("yolopipe-ray", 0)] / best[("yolopipe", 0)], 3)
    return out


def log(msg: str) -> None:
    print(f"[ray_predict] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
