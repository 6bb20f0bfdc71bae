"""The inference worker's own host CPU per request, with the device emulated.

One inference worker (the process that owns the GPU and answers every HTTP worker) runs its
real serving loop (``app.service.inference.worker._serve``: socket, rings, batcher, answers) in front of
a stand-in pipeline that costs almost no CPU (``bench/emulated_device.py``): each batch waits
``n / rate`` seconds with the GIL released (a serial device at ``--rate`` images/s, like a CUDA
sync) and returns ``--rows`` detections per image, with the stage-timing keys of the GPU pipeline. JPEG bytes
pass through undecoded, as they do to the GPU decoder. Client processes drive it through the
real ``InferenceClient`` (ring + descriptors, the HTTP worker's side), with no HTTP; each
holds ``--links`` connections (default 7: two processes make the fan-in of the H200's fourteen
HTTP workers), so a batch's answers go out in as many frames as in the service.

Reported per variant: requests/s, and the inference worker's CPU time (user + system, all its
threads) per answered request in the measured window. At 5,000 req/s one core allows 200 µs
per request for everything that process does; the device itself is not in the figure.

Variants are code trees: ``--baseline REV`` exports that git revision to a temporary folder
and runs the same measurement on it, interleaved round by round with this tree (A/B/A/B).
``--profile`` adds one py-spy ``--gil`` recording of each variant's worker (top functions by
samples holding the GIL; py-spy must be on PATH).

    python bench/worker_host_cost.py --baseline main --rounds 4 --seconds 8 \
        --out bench/results/<date>-<machine>-worker-host-cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
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
SOURCE = (640, 480)  # the emulated images' size (width, height): the synthetic rows lie within it


# ------------------------------------------------------------------ the stand-in device
def emulated_device(args):
    """``bench/emulated_device.py``'s device with ``--rows`` synthetic detections per image (two
    batches in flight, as this benchmark has always run it)."""
    from bench.emulated_device import EmulatedDevice, Replay, generic_meta, synthetic_rows

    return EmulatedDevice(Replay(generic_meta()), args.rate, max_batch=args.max_batch, in_flight=2,
                          fallback=synthetic_rows(args.rows, SOURCE))


def _image(quality: int = 90) -> bytes:
    """A 640×480 JPEG of about a photo's size (smooth shapes and some noise)."""
    import cv2
    import numpy as np

    w, h = SOURCE
    rng = np.random.default_rng(1)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 127 // (w + h))], -1).astype(np.int16)
    noisy = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    ok, data = cv2.imencode(".jpg", noisy, [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return data.tobytes()


# ------------------------------------------------------------------ the roles (child processes)
class _Report:
    def send(self, message) -> None:
        print(json.dumps(["report", message[0]]), flush=True)


def run_worker(args) -> None:
    from app.service.processes import write_metrics_to

    layout_root = Path(args.layout)
    write_metrics_to(layout_root / "metrics")  # as a real worker: metrics in files, before prometheus_client loads
    from app.config import Settings
    from app.contracts import RunShape
    from app.ipc.layout import RunLayout
    from app.pipeline.detector import Detector
    from app.service.inference import worker

    try:  # what worker_main does first, in the trees that have it
        from app.heap import limit_malloc_arenas
    except ImportError:
        limit_malloc_arenas = None
    if limit_malloc_arenas is not None:
        limit_malloc_arenas(2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = Settings(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, request_timeout_s=30.0)
    device = emulated_device(args)
    batches = collections.Counter()  # device runs and their images (a batch's size is a run fact: no answer has it)
    device_run = device.run

    def counted(images, params, **kwargs):
        batches.update(runs=1, images=len(images))
        return device_run(images, params, **kwargs)

    device.run = counted
    detector = Detector(device, RunShape(max_batch=args.max_batch, in_flight=device.in_flight,
                                         max_wait_ms=args.max_wait_ms, letterbox=device.letterbox))
    spec = worker.WorkerSpec(0, None, RunLayout(layout_root, 1), 0, os.getppid())
    serve = getattr(worker, "_run", None)  # where older trees kept it
    if serve is None:
        from app.service.processes import run_event_loop as serve
    serve(worker._serve(spec, settings, detector, _Report()))
    print(json.dumps(["batches", batches["runs"], batches["images"]]), flush=True)


def run_client(args) -> None:
    from app.config import Settings
    from app.contracts import DetectParams
    from app.errors import YolopipeError
    from app.imaging.check import check_image
    from app.ipc.client import InferenceClient
    from app.ipc.layout import RunLayout

    data = _image()
    header = check_image(data)
    # A small ring per link: --links of them per process, each as an HTTP worker's.
    settings = Settings(max_batch=args.max_batch, request_timeout_s=30.0, ring_mb=8, max_body_bytes=1 << 20)
    start, end = args.start, args.end
    counts = collections.Counter()
    latencies: list[float] = []
    refusals: collections.Counter = collections.Counter()

    async def loop_one(client) -> None:
        params = DetectParams()
        while time.monotonic() < end:
            sent = time.monotonic()
            try:
                answers = await client.detect([data], params, [header])
                ok = not answers.detected.errors and int(answers.detected.counts[0]) == args.rows
                key = "ok" if ok else "wrong"
            except YolopipeError as exc:
                key = exc.code
                refusals[str(exc)] += 1
                await asyncio.sleep(0.001)
            answered = time.monotonic()
            if sent >= start and answered <= end:
                counts[key] += 1
                latencies.append(answered - sent)

    async def main() -> None:
        clients = [InferenceClient(settings, RunLayout(Path(args.layout), 1)) for _ in range(args.links)]
        for client in clients:
            await client.start(wait_s=60.0)
        await asyncio.gather(*(loop_one(clients[i % len(clients)]) for i in range(args.concurrency)))
        for client in clients:
            await client.close()

    import uvloop

    uvloop.run(main())
    Path(args.result).write_text(json.dumps({"counts": counts, "latencies": latencies, "refusals": refusals}))


# ------------------------------------------------------------------ the orchestrator
def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system time of every thread of ``pid`` so far (or of its thread ``tid``)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def export_tree(rev: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "app"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(tree: Path, args, profile_to: Path | None = None) -> dict:
    """One run of one variant: start its worker, drive it, read its CPU time over the window."""
    from app.ipc.layout import RunLayout

    layout = RunLayout.create(1)
    env = {**os.environ, "PYTHONPATH": str(tree), "YOLOPIPE_CODE_TREE": str(tree)}
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--layout", str(layout.root), "--max-batch", str(args.max_batch), "--rows", str(args.rows),
              "--links", str(args.links)]
    worker = subprocess.Popen([*me, "--role", "worker", "--rate", str(args.rate), "--max-wait-ms",
                               str(args.max_wait_ms), *common], env=env, stdout=subprocess.PIPE, text=True)
    clients: list[subprocess.Popen] = []
    try:
        for line in worker.stdout:
            if line.startswith('["report"'):
                assert json.loads(line)[1] == "ready", line
                break
        else:
            raise RuntimeError("the worker ended before it was ready")
        start = time.monotonic() + args.warmup
        end = start + args.seconds
        for k in range(args.clients):
            clients.append(subprocess.Popen(
                [*me, "--role", "client", "--concurrency", str(args.concurrency), "--start", str(start),
                 "--end", str(end), "--result", str(layout.root / f"client-{k}.json"), *common], env=env))
        time.sleep(max(0.0, start - time.monotonic()))
        cpu0, loop0 = cpu_seconds(worker.pid), cpu_seconds(worker.pid, worker.pid)
        spy = None
        if profile_to is not None:
            spy = subprocess.Popen(["py-spy", "record", "--gil", "--nonblocking", "--rate", "1000", "--format", "raw",
                                    "--duration", str(int(args.seconds)), "--pid", str(worker.pid),
                                    "--output", str(profile_to)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        time.sleep(max(0.0, end - time.monotonic()))
        cpu1, loop1 = cpu_seconds(worker.pid), cpu_seconds(worker.pid, worker.pid)
        for c in clients:
            c.wait(timeout=120)
        results = [json.loads((layout.root / f"client-{k}.json").read_text()) for k in range(len(clients))]
        if spy is not None:
            spy.wait(timeout=120)
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        worker.send_signal(signal.SIGTERM)
        try:
            said = worker.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            worker.kill()
            said = ""
        layout.remove()
    runs = [json.loads(line) for line in said.splitlines() if line.startswith('["batches"')]
    counts = collections.Counter()
    latencies = []
    for r in results:
        counts.update(r["counts"])
        latencies += r["latencies"]
    ok = counts.get("ok", 0)
    refusals = collections.Counter()
    for r in results:
        refusals.update(r["refusals"])
    latencies.sort()
    pct = (lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3, 2)) if latencies else (
        lambda q: None)
    return {"requests_per_s": round(ok / args.seconds, 1), "worker_cpu_us_per_request": round(
        (cpu1 - cpu0) / max(ok, 1) * 1e6, 1), "worker_cores_busy": round((cpu1 - cpu0) / args.seconds, 3),
        # the event loop's thread (reading descriptors, admitting, writing answers) and the rest
        # (the batch threads: batching, the stand-in device's call, answers as arrays)
        "loop_thread_us_per_request": round((loop1 - loop0) / max(ok, 1) * 1e6, 1),
        "other_threads_us_per_request": round((cpu1 - cpu0 - loop1 + loop0) / max(ok, 1) * 1e6, 1),
        "answers": dict(counts), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
        # over the whole run (warm-up included): the worker's device runs, as it counted them
        "mean_batch_size": round(runs[0][2] / max(runs[0][1], 1), 1) if runs else None, "refusals": dict(refusals)}


def top_functions(raw: Path, n: int = 25) -> dict:
    """py-spy's raw (collapsed) stacks → the share of GIL-holding samples per function, self and total."""
    own, total, samples = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f
                  for f in stack.split(";")[1:]]  # the first frame is the thread
        samples += k
        if frames:
            own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
    share = lambda c: {f: round(100 * v / max(samples, 1), 1) for f, v in c.most_common(n)}
    return {"samples": samples, "self_percent": share(own), "total_percent": share(total)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("bench", "worker", "client"), default="bench")
    p.add_argument("--layout")
    p.add_argument("--start", type=float)
    p.add_argument("--end", type=float)
    p.add_argument("--result", help="where a client writes its counts")
    p.add_argument("--rate", type=float, default=7000.0, help="the emulated device's images/s")
    p.add_argument("--rows", type=int, default=20, help="detections per image")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=2, help="client processes (HTTP workers' stand-ins)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight per client process")
    p.add_argument("--links", type=int, default=7, help="connections to the worker per client process (each an "
                   "HTTP worker's: its own ring and socket; the answers of a batch go out one frame per link)")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="a git revision measured beside this tree, interleaved")
    p.add_argument("--profile", action="store_true", help="one py-spy --gil recording per variant")
    p.add_argument("--out")
    args = p.parse_args()
    if args.role != "bench":
        sys.path.insert(0, os.environ.get("YOLOPIPE_CODE_TREE", str(ROOT)))
        sys.path.append(str(ROOT))  # bench's own modules (the emulated device); the app comes from the tree
        (run_worker if args.role == "worker" else run_client)(args)
        return

    sys.path.insert(0, str(ROOT))
    from app.benchmark.machine import machine_info, versions

    variants = {"this": ROOT}
    scratch = Path(tempfile.mkdtemp(prefix="yolopipe-bench-"))
    try:
        if args.baseline:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], check=True,
                                 capture_output=True, text=True).stdout.strip()
            variants = {f"baseline {rev}": export_tree(rev, scratch / "baseline"), "this": ROOT}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name, tree in variants.items():
                result = measure(tree, args)
                runs[name].append(result)
                print(f"round {r + 1} {name}: {result}", file=sys.stderr, flush=True)
        profiles = {}
        if args.profile:
            if shutil.which("py-spy") is None:
                raise SystemExit("--profile needs py-spy on PATH")
            for name, tree in variants.items():
                raw = scratch / f"{name.split()[0]}.txt"
                measure(tree, args, profile_to=raw)
                profiles[name] = top_functions(raw) if raw.exists() else {"error": "py-spy wrote nothing"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    answered = {name: [x for x in rs if x["requests_per_s"]] for name, rs in runs.items()}  # a round may fail whole
    summary = {name: {key: round(statistics.median(x[key] for x in rs), 2) if rs else None for key in
                      ("requests_per_s", "worker_cpu_us_per_request", "loop_thread_us_per_request",
                       "other_threads_us_per_request", "worker_cores_busy", "p99_ms")} for name, rs in answered.items()}
    out = {
        "benchmark": "worker_host_cost",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine_info(), "nproc": os.cpu_count(), "note": "shared with other jobs"},
        "versions": versions(("numpy", "uvloop", "prometheus-client", "fastapi")),
        "commit": commit,
        "setup": {k: getattr(args, k) for k in ("rate", "rows", "max_batch", "max_wait_ms", "clients", "concurrency",
                                                "links", "seconds", "warmup", "rounds")},
        "image_bytes": len(_image()),
        "median": summary,
        "runs": runs,
        "profiles": profiles,
    }
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
