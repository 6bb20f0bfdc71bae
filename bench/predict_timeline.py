"""Where ``yolopipe predict``'s time goes, seen from inside: the real command, one fresh process
per round, with the folder loop's and the GPU pipeline's steps stamped (thread, seconds from the
process's start), and the folder loop's knobs varied between rounds, interleaved.

Each round of each variant runs ``yolopipe predict FOLDER`` through ``app.cli.main`` in a child
process that wraps, before the command imports them, the folder's reads
(``app.predict.folder._prepared_chunk``), each batch's answer, its way through the GPU pipeline
(nvImageCodec's ``decode_into``, the wait for the device, captures) and the pipeline's ``close``
with its decoders'; the wrappers only append ``(time, thread, step)`` to a list, written when
the command exits. A row per process:

* ``first_result_s``: to the first batch handed back to the writer; ``exit_s``: to ``os._exit``;
* ``steady_img_per_s``: the images of the 4th batch on over the time from the 3rd batch's
  answer to the last one's (the captures of the first batches and the end left out);
* ``after_first_img_per_s``: what ``bench/startup.py`` holds to the engine's rate (the images
  after the first batch over the time from it to the exit);
* median milliseconds per batch in the steady part: ``read_ms`` (a reader's chunk, per 64
  images), ``decode_ms`` (``decode_into`` of a batch), ``device_wait_ms`` (from the launch to the
  batch's done event); ``close_s`` (the pipeline's ``close``) and its decoders' share.

Knobs (``--variants``, each ``name:readers:switch``): the folder's reader threads
(``READERS_ENCODED``) and Python's switch interval (``sys.setswitchinterval``, seconds; 0: the
default).

    python bench/predict_timeline.py --images .data/images --copies 10000 --rounds 3 \\
        --variants readers2:2:0,readers1:1:0 --out bench/results/DATE-MACHINE-predict-timeline.json
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

T0 = time.perf_counter()
EVENTS: list[tuple[float, str, str]] = []


def stamp(step: str) -> None:
    EVENTS.append((round(time.perf_counter() - T0, 5), threading.current_thread().name, step))


def wrap(owner, attr: str, step: str) -> None:
    fn = getattr(owner, attr)

    def stamped(*args, **kwargs):
        stamp(step + ">")
        try:
            return fn(*args, **kwargs)
        finally:
            stamp(step + "<")

    setattr(owner, attr, stamped)


# module: (attribute that says it is loaded, [(owner attribute path, step)])
TARGETS = {
    "app.predict.folder": ("predict_folder", [("_prepared_chunk", "read")]),
    "app.pipeline.gpu": ("GpuPipeline", [("GpuPipeline.close", "close")]),
    "app.gpu.nvimgcodec": ("NvImageCodecDecoder", [("NvImageCodecDecoder.decode_into", "decode")]),
    "app.gpu.dispatch": ("Dispatcher", [("Dispatcher.wait", "device_wait")]),
    "app.gpu.capture": ("GraphBuilder", [("GraphBuilder._capture_once", "capture")]),
    "app.gpu.decode": ("Decoders", [("Decoders.close", "decoders_close")]),
}


def child(out: Path, readers: int, switch: float, argv: list[str]) -> None:
    """Run the command with its steps stamped; the stamps go to ``out`` at exit."""
    done: set[str] = set()
    real_import = builtins.__import__

    def patch_loaded() -> None:
        for module, (marker, wraps) in TARGETS.items():
            mod = sys.modules.get(module)
            if module in done or mod is None or not hasattr(mod, marker):
                continue
            done.add(module)
            for path, step in wraps:
                *owner_path, attr = path.split(".")
                owner = mod
                for name in owner_path:
                    owner = getattr(owner, name)
                wrap(owner, attr, step)
            if module == "app.predict.folder":
                if readers:
                    mod.READERS_ENCODED = readers
                loop = mod.run_overlapped

                def answered(fn, items, in_flight, loop=loop):
                    for result in loop(fn, items, in_flight):
                        stamp("answer")
                        yield result

                mod.run_overlapped = answered

    def importing(name, *args, **kwargs):
        module = real_import(name, *args, **kwargs)
        if len(done) < len(TARGETS):
            patch_loaded()
        return module

    builtins.__import__ = importing
    if switch:
        sys.setswitchinterval(switch)
    real_exit = os._exit

    def write_stamps() -> None:
        if not out.exists():
            stamp("exit")
            out.write_text(json.dumps(EVENTS))

    def exit_with_stamps(code: int) -> None:  # the CLI's exit where torch is loaded (app.cli.exit_now)
        write_stamps()
        real_exit(code)

    os._exit = exit_with_stamps
    atexit.register(write_stamps)  # the interpreter's own ending otherwise
    from app.cli import main

    sys.argv = ["yolopipe", *argv]
    main()


def summarize(events: list, images: int, batch: int) -> dict:
    answers = [t for t, _, step in events if step == "answer"]
    exit_s = next(t for t, _, step in events if step == "exit")
    spans: dict[str, list[tuple[float, float]]] = {}
    opened: dict[tuple[str, str], float] = {}
    for t, thread, step in events:
        name, edge = step[:-1], step[-1]
        if edge == ">":
            opened[(thread, name)] = t
        elif edge == "<" and (thread, name) in opened:
            spans.setdefault(name, []).append((opened.pop((thread, name)), t))
    steady_from = answers[2] if len(answers) > 3 else answers[0]

    def median_ms(name: str, per: float = 1.0) -> float | None:
        d = [(b - a) * per for a, b in spans.get(name, []) if a > steady_from]
        return round(statistics.median(d) * 1e3, 2) if d else None

    reads = spans.get("read", [])
    per_read = batch / max(1, round(images / max(1, len(reads)))) if reads else 1.0  # a chunk's images → 64
    steady = round((len(answers) - 3) * batch / (answers[-1] - steady_from)) if len(answers) > 3 else None
    return {
        "first_result_s": round(answers[0], 3), "exit_s": round(exit_s, 3), "steady_img_per_s": steady,
        "after_first_img_per_s": round((images - batch) / (exit_s - answers[0])),
        "read_ms": median_ms("read", per_read), "decode_ms": median_ms("decode"),
        "device_wait_ms": median_ms("device_wait"),
        "captures": len(spans.get("capture", [])),
        "close_s": round(sum(b - a for a, b in spans.get("close", [])), 3),
        "decoders_close_s": round(sum(b - a for a, b in spans.get("decoders_close", [])), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, default=ROOT / ".data" / "images", help="photos copied --copies times")
    p.add_argument("--copies", type=int, default=10000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="readers2:2:0,readers1:1:0",
                   help="comma-separated name:readers:switch_interval (readers 0: the code's own; switch 0: Python's)")
    p.add_argument("--out", type=Path)
    if sys.argv[1:2] == ["--child"]:  # --child STAMPS READERS SWITCH, then the command's own arguments, untouched
        stamps, readers, switch, *command = sys.argv[2:]
        child(Path(stamps), int(readers), float(switch), command)
        return
    args = p.parse_args()
    from app.benchmark.machine import code_revision, machine_info, versions
    from bench.startup import gpu_present, make_folder

    variants = [dict(zip(("name", "readers", "switch"), v.split(":"))) for v in args.variants.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="predict-timeline-") as tmp:
        scratch = Path(tmp)
        folder = make_folder(args.images, args.copies, scratch / "folder")
        for r in range(1, args.rounds + 1):
            for v in variants:
                stamps, out = scratch / f"stamps-{r}-{v['name']}.json", scratch / "out.jsonl"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(stamps), v["readers"], v["switch"],
                       "predict", folder, "--out", str(out), "--batch", str(args.batch)]
                started = time.monotonic()
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
                row = {"variant": v["name"], "readers": int(v["readers"]), "switch_interval_s": float(v["switch"]),
                       "round": r, "exit_code": proc.returncode, "wall_s": round(time.monotonic() - started, 3)}
                if proc.returncode == 0:
                    row.update(summarize(json.loads(stamps.read_text()), args.copies, args.batch))
                else:
                    row["log_tail"] = (proc.stdout + proc.stderr)[-2000:]
                print(json.dumps(row), flush=True)
                rows.append(row)
    keys = ("wall_s", "first_result_s", "steady_img_per_s", "after_first_img_per_s", "read_ms", "decode_ms",
            "device_wait_ms", "close_s", "decoders_close_s")
    summary = {v["name"]: {k: statistics.median(vals) for k in keys
                           if (vals := [r[k] for r in rows if r["variant"] == v["name"] and r.get(k) is not None])}
               for v in variants}
    what = "bench/predict_timeline.py: predict's steps stamped from inside (see its docstring); medians in summary"
    result = {"what": what,
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": {**machine_info(gpu=gpu_present()), "nproc": os.cpu_count()}, "versions": versions(),
              "code": code_revision() or "unknown (no git here)",
              "config": {"files": args.copies, "batch": args.batch, "rounds": args.rounds, "variants": variants},
              "summary": summary, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
