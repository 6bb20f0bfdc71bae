"""Issue #39's GPU run: ``yolopipe calibrate`` with its defaults where there is a GPU (so with
distillation), then ``--distill off`` (the PTQ models of the same export, from the first run's
caches), each timed as a user runs it; the four models brought back for scoring.

The models are scored on another distribution beside NNCF's and ModelOpt's, in one run, on the
CPU machine (``bench/int8_libraries.py --calibration <the same images> --import ...``): the GPU
machine has neither library. ``model.int8.onnx`` (44 MB) goes back packed
(``bench/int8_transport.py``: its weights as the int8 codes its Q nodes make of them, 15 MB).

Writes under ``--out``: ``int8-device.json`` (machine, versions, each command's wall time, exit
status, its report's timings, distillation and figures), each run's ``int8_report.json``, and
``models/{distilled,ptq}-{model.int8-cpu.onnx,model.int8.packed.onnx}`` (left out of the pack,
each under the 16 MiB a file may be to come back).

    python bench/int8_device.py --images .data/int8-calibration --out $OUT    # tools/device/run.sh int8
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.benchmark.machine import machine_info, versions
from bench.int8_transport import pack

RUNS = (("distilled", []), ("ptq", ["--distill", "off"]))  # the default first: its wall time is a first run's


def git_commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=Path, default=Path(".data/int8-calibration"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--weights", default="sample")
    ap.add_argument("--commit", default=None, help="the commit the copy here is of (a device copy has no .git)")
    ap.add_argument("--runs", default="distilled,ptq", help="of distilled (the defaults), ptq (--distill off)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "yolopipe-int8-device",
                    help="the artifacts folder: kept, so that a later call on a warm machine reuses its export and caches")
    args = ap.parse_args()
    wanted = args.runs.split(",")
    if not wanted or any(r not in dict(RUNS) for r in wanted):
        ap.error(f"--runs names runs of {', '.join(dict(RUNS))}")
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    models = args.out / "models"
    models.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "app.cli", "calibrate", "--weights", args.weights, "--images", str(args.images),
           "--artifacts-dir", str(work)]
    subprocess.run([sys.executable, "-m", "app.cli", "export", "--weights", args.weights, "--artifacts-dir", str(work)],
                   check=True)  # not timed: a user's export is its own step
    model_dir = next(work.glob("*/imgsz640"))
    summary = args.out / "int8-device.json"
    machine = {"machine": machine_info(gpu=_has_gpu()), "versions": versions()}  # once: nvidia-smi, imports
    runs = json.loads(summary.read_text())["runs"] if summary.is_file() else {}
    for label, extra in RUNS:
        if label not in wanted:
            continue
        t0 = time.perf_counter()
        proc = subprocess.run([*cli, *extra], capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        (args.out / f"int8-{label}.log").write_text(proc.stdout + proc.stderr)
        print(proc.stderr[-4000:], flush=True)
        if proc.returncode not in (0, 1):  # 1: the gate refused; the report is still written
            runs[label] = {"command": ["yolopipe", *cli[3:], *extra], "exit_status": proc.returncode,
                           "wall_s": round(wall, 1), "error": proc.stderr[-2000:]}
            write_summary(summary, args, machine, runs, models)
            continue
        report = json.loads((model_dir / "int8_report.json").read_text())
        shutil.copyfile(model_dir / "int8_report.json", args.out / f"int8-{label}-report.json")
        runs[label] = {
            "command": ["yolopipe", *cli[3:], *extra], "exit_status": proc.returncode, "wall_s": round(wall, 1),
            "histograms_from_cache": report["cache_hit"], "timings_s": report["timings_s"],
            "distillation": report["distillation"],
            "own_report": {"heldout_images": len(report["heldout_images"]),
                           "tensorrt": {k: report[k] for k in ("f1", "f1_ci95", "map50", "mean_score_drift")},
                           "cpu": {k: report["cpu_variant"][k] for k in ("f1", "f1_ci95", "map50", "mean_score_drift")}},
            "mixed_precision": {t: v["layers"] for t, v in report["mixed_precision"].items()},
        }
        shutil.copyfile(model_dir / "model.int8-cpu.onnx", models / f"{label}-model.int8-cpu.onnx")
        pack(model_dir / "model.int8.onnx", models / f"{label}-model.int8.packed.onnx")
        write_summary(summary, args, machine, runs, models)  # after each run: a call cut off keeps what it did
    print(json.dumps({k: {"wall_s": v["wall_s"], "exit": v["exit_status"], "own": v["own_report"],
                          "distillation": {t: {"kept": m["kept"], "ptq": m["ptq"]["f1"], "distilled": m["distilled"]["f1"],
                                               "steps": m["training"]["steps"], "s": m["training"]["seconds"]}
                                           for t, m in v["distillation"]["models"].items()}}
                      for k, v in runs.items() if "error" not in v}, indent=1))


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def write_summary(path: Path, args, machine: dict, runs: dict, models: Path) -> None:
    result = {
        "bench": "int8-device", "issue": 39, "date": dt.date.today().isoformat(), "commit": args.commit or git_commit(),
        **machine,
        "calibration_set": f"{args.images}: 84 images (bench/int8_heldout.py --calibration-only: the 20 photos and "
                           "every 3rd frame of dance.avi at 640 pixels); each run holds 42 out for its own report",
        "runs": runs,
        "models": sorted(p.name for p in models.iterdir()),
    }
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
