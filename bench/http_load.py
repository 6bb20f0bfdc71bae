"""HTTP load benchmark: yolopipe's server against the naive Ultralytics server, in one run, with wrk.

``host`` (``--parts host``; first when given, with servers of its own): the host tier with the
device emulated, on any machine: yolopipe's server tree's CPU per answered request for
``/v1`` multipart, ``/v1`` raw JPEG, OIP binary and gRPC, each beside a bare reference server
(FastAPI on the same uvicorn; ``grpc.aio``), rounds interleaved; ``--profile`` adds py-spy
profiles of each process kind (``bench/host_tier.py``).

The other parts (``--parts``, in this order, on one yolopipe server):

* ``load``: closed loop at each ``--clients`` count (wrk, one connection per thread, multipart
  640×480 JPEGs): req/s, p50/p99/p99.9 of the 200s, answers by status, socket errors, and
  the server's CPU (its whole process tree); then the same images through the Open Inference
  Protocol at each ``--oip-clients`` count (binary tensors), and KServe v2 gRPC ``ModelInfer`` at
  each ``--grpc-clients`` count (h2load, ``bench/grpc_client.py``: rows with ``"part": "grpc"``).
  The naive server at the same counts runs first.
* ``soak``: open loop at ``--soak-rate`` (default: twice the capacity ``load`` measured)
  for ``--soak-minutes``, RSS (PSS) of the server's processes and GPU memory sampled; pass
  fields: only 200/503, memory flat within 5 %, served ≥ 90 % of capacity.
* ``kill``: closed loop at the first client count; the inference worker is killed (SIGKILL)
  a third of the way in: answers must stay 200/503 with no socket error; the seconds until the
  first 200 and the answers lost are reported.
* ``sigterm``: closed loop; the server gets SIGTERM a third of the way in and must exit 0.
  Last: it ends the server.

Every row carries ``clients`` (connections) and ``gpus``; the load rows run once per entry of
``TARGETS`` (input name, path).

    python bench/http_load.py --images .data/images --parts load,soak,kill --out bench/results/x.json
    python bench/http_load.py --smoke   # a few seconds each, to prove it runs (CPU)
    python bench/http_load.py --parts host --images DIR --out bench/results/x.json   # any machine

Results: one JSON file with the machine, versions, commit, configuration, rows and checks.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import code_revision, machine_info, versions
from bench.grpc_client import run_h2load
from bench.host_tier import INPUTS as HOST_INPUTS
from bench.host_tier import run_host, serving_env
from bench.server_meter import Server, cpu_us_per_request, wait_for_standbys
from bench.wrk_client import OIP_SCRIPT, run_wrk

RESULTS = ROOT / "bench" / "results"
# What a load row sends: (input name, path). Another protocol's row is one more entry (and, if
# its body differs, its own wrk script).
TARGETS: list[tuple[str, str]] = [("http-multipart", "/v1/detect")]


# ----------------------------------------------------------------------------- inputs
def prepare_images(folder: Path | None, size: tuple[int, int], limit: int, out: Path) -> tuple[Path, dict]:
    """JPEGs of exactly ``size`` (centre crop to its aspect, then resize; quality 95) and a list file."""
    import cv2

    if folder is None:
        import importlib.util

        folder = Path(importlib.util.find_spec("ultralytics").origin).parent / "assets"
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))[:limit]
    if not files:
        raise SystemExit(f"no images in {folder}")
    w, h = size
    paths = []
    for i, f in enumerate(files):
        img = cv2.imread(str(f))
        ih, iw = img.shape[:2]
        crop_w, crop_h = min(iw, round(ih * w / h)), min(ih, round(iw * h / w))
        x, y = (iw - crop_w) // 2, (ih - crop_h) // 2
        img = cv2.resize(img[y : y + crop_h, x : x + crop_w], (w, h), interpolation=cv2.INTER_AREA)
        path = out / f"img{i:03d}.jpg"
        cv2.imwrite(str(path), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
        paths.append(path)
    listing = out / "images.txt"
    listing.write_text("\n".join(str(p) for p in paths) + "\n")
    sizes = [p.stat().st_size for p in paths]
    return listing, {"folder": str(folder), "count": len(paths), "size": f"{w}x{h}",
                     "mean_bytes": round(sum(sizes) / len(sizes))}


# ----------------------------------------------------------------------------- servers
def start_yolopipe(args: argparse.Namespace, logdir: Path) -> Server:
    cmd = [sys.executable, "-m", "app.cli", "serve", "--weights", args.weights, "--backend", args.backend,
           "--precision", args.precision, "--host", "127.0.0.1", "--port", "{port}",
           "--grpc-port", "{grpc_port}" if args.grpc_clients else "0",
           "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms)]
    return Server("yolopipe", cmd, serving_env(args), logdir / "yolopipe_server.log")


def start_naive(args: argparse.Namespace, logdir: Path) -> Server:
    from app.weights import resolve_weights

    device = "cpu" if args.backend == "onnxruntime" or not machine_info()["gpus"] else "0"
    weights = resolve_weights(args.weights).path
    cmd = [sys.executable, str(ROOT / "bench" / "naive_server.py"), "--weights", str(weights),
           "--port", "{port}", "--workers", str(args.naive_workers), "--device", device]
    server = Server(f"naive-ultralytics-{args.naive_workers}w", cmd, {**os.environ, "YOLO_OFFLINE": "1"},
                    logdir / "naive_server.log")
    server.gpus = 0 if device == "cpu" else 1
    return server


def measure(server: Server, listing: Path, clients: int, args: argparse.Namespace,
            target: tuple[str, str] = TARGETS[0]) -> dict:
    name, path = target
    url = f"{server.url}{path}"
    if args.warmup > 0:
        run_wrk(url, listing, connections=clients, duration_s=args.warmup, wrk=args.wrk)
    with server.meter.cpu() as cpu:
        row = run_wrk(url, listing, connections=clients, duration_s=args.duration, wrk=args.wrk)
    row = {"system": server.name, "input": name, "clients": clients, "gpus": server.gpus, **row, **cpu.result}
    row["server_cpu_us_per_request"] = cpu_us_per_request(row)
    print(f"{server.name:>24} c={clients:<4} {row['req_per_s']:>8.1f} req/s  p50 {row['p50_ms']} ms  "
          f"p99 {row['p99_ms']} ms  p99.9 {row['p999_ms']} ms  {row['statuses']}  cpu {row['server_cpu_cores']} cores",
          flush=True)
    return row


def measure_oip(server: Server, listing: Path, clients: int, args: argparse.Namespace) -> dict:
    """The same images through the Open Inference Protocol (binary tensors, bench/wrk/oip.lua)."""
    url = f"{server.url}/v2/models/yolopipe/infer"
    if args.warmup > 0:
        run_wrk(url, listing, connections=clients, duration_s=args.warmup, wrk=args.wrk, script=OIP_SCRIPT)
    with server.meter.cpu() as cpu:
        row = run_wrk(url, listing, connections=clients, duration_s=args.duration, wrk=args.wrk, script=OIP_SCRIPT)
    row = {"system": server.name, "input": "http-oip-binary", "part": "oip", "clients": clients, "gpus": server.gpus,
           **row, **cpu.result}
    row["server_cpu_us_per_request"] = cpu_us_per_request(row)
    print(f"{'yolopipe OIP':>24} c={clients:<4} {row['req_per_s']:>8.1f} req/s  p50 {row['p50_ms']} ms  "
          f"p99 {row['p99_ms']} ms  {row['statuses']}  cpu {row['server_cpu_cores']} cores", flush=True)
    return row


def measure_grpc(server: Server, listing: Path, clients: int, args: argparse.Namespace) -> dict:
    """KServe v2 gRPC ModelInfer with h2load: one of the photos, as tritonclient.grpc sends it."""
    image = Path(listing.read_text().split()[0]).read_bytes()
    run = {"clients": clients, "metrics_url": f"{server.url}/metrics", "h2load": args.h2load}
    try:
        if args.warmup > 0:
            run_h2load("127.0.0.1", server.grpc_port, image, duration_s=args.warmup, **run)
        with server.meter.cpu() as cpu:
            row = run_h2load("127.0.0.1", server.grpc_port, image, duration_s=args.duration, **run)
    except (RuntimeError, SystemExit) as exc:  # no h2load here: the other rows stand
        print(f"gRPC row at c={clients} not measured: {exc}", flush=True)
        return {"system": server.name, "input": "grpc-model-infer", "part": "grpc", "clients": clients,
                "gpus": server.gpus, "req_per_s": None, "error": str(exc)[-500:]}
    row = {"system": server.name, "input": "grpc-model-infer", "part": "grpc", "gpus": server.gpus, **row,
           **cpu.result}
    row["server_cpu_us_per_request"] = cpu_us_per_request(row)
    print(f"{'yolopipe gRPC':>24} c={clients:<4} {row['req_per_s']:>8.1f} req/s  p50 {row['p50_ms']} ms  "
          f"p99 {row['p99_ms']} ms  {row['grpc_codes']}  cpu {row['server_cpu_cores']} cores", flush=True)
    return row


# ----------------------------------------------------------------------------- parts
def part_kill(server: Server, listing: Path, args: argparse.Namespace) -> dict:
    """SIGKILL the inference worker a third of the way into a closed-loop run."""
    import httpx

    clients = args.clients[0]
    workers = httpx.get(f"{server.url}/v1/model", timeout=10).json()["serving"]["inference_workers"]
    victim = workers[0]["pid"]
    body = Path(listing.read_text().split()[0]).read_bytes()
    probe: dict = {}

    def kill_and_probe() -> None:
        time.sleep(args.duration / 3)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        not_ready = None
        while time.monotonic() - killed < max(args.duration, 90.0):  # a restart may outlast the row
            if not_ready is None and httpx.get(f"{server.url}/readyz", timeout=5).status_code == 503:
                not_ready = time.monotonic() - killed
            r = httpx.post(f"{server.url}/v1/detect", content=body, headers={"content-type": "image/jpeg"},
                           timeout=60)
            if r.status_code == 200:
                probe.update(serving_again_s=round(time.monotonic() - killed, 2))
                break
            time.sleep(0.05)
        probe.update(readyz_false_seen_after_s=None if not_ready is None else round(not_ready, 3))

    killer = threading.Thread(target=kill_and_probe)
    killer.start()
    row = run_wrk(f"{server.url}/v1/detect", listing, connections=clients, duration_s=args.duration, wrk=args.wrk)
    killer.join()
    row = {"system": server.name, "input": "http-multipart", "part": "kill", "clients": clients, "gpus": server.gpus,
           "killed_pid": victim, **row, **probe}
    # Answers lost: every request of the run that did not get its 200 (503s while the worker was
    # away, socket errors), beside the seconds until the first 200 after the kill.
    statuses = {str(k): v for k, v in row.get("statuses", {}).items()}
    errors = row.get("socket_errors") or {}
    row["answers_lost"] = sum(v for k, v in statuses.items() if k != "200") + (
        sum(errors.values()) if isinstance(errors, dict) else int(errors or 0))
    row["first_200_after_kill_s"] = probe.get("serving_again_s")
    row["serving_again_within_5s"] = probe.get("serving_again_s") is not None and probe["serving_again_s"] <= 5
    print(f"kill: first 200 after {probe.get('serving_again_s')} s; {row['answers_lost']} answers lost; "
          f"{row['statuses']} socket errors {row['socket_errors']}", flush=True)
    return row


def part_sigterm(server: Server, listing: Path, args: argparse.Namespace) -> dict:
    """SIGTERM the server a third of the way into a closed-loop run: it must finish what it
    admitted and exit 0 (answers before it stopped listening are 200/503). Last: it ends the server."""
    clients = args.clients[0]
    stopped: dict = {}

    def terminate() -> None:
        time.sleep(args.duration / 3)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            stopped["exit_code"] = server.proc.wait(120)
        except subprocess.TimeoutExpired:
            stopped["exit_code"] = None
        stopped["exit_s"] = round(time.monotonic() - sent, 2)

    stopper = threading.Thread(target=terminate)
    stopper.start()
    row = run_wrk(f"{server.url}/v1/detect", listing, connections=clients, duration_s=args.duration, wrk=args.wrk)
    stopper.join()
    statuses = {str(k) for k in row.get("statuses", {})}
    row = {"system": server.name, "input": "http-multipart", "part": "sigterm", "clients": clients,
           "gpus": server.gpus, **row, **stopped}
    row["pass"] = stopped.get("exit_code") == 0 and statuses <= {"200", "503"}
    print(f"sigterm: exit {stopped.get('exit_code')} after {stopped.get('exit_s')} s; {row['statuses']}", flush=True)
    return row


def part_soak(server: Server, listing: Path, rate: float, capacity: float | None, args: argparse.Namespace) -> dict:
    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.wait(args.sample_s):
            samples.append({"t_s": round(time.monotonic() - t0, 1), **server.meter.memory()})

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with server.meter.cpu() as cpu:
            row = run_wrk(f"{server.url}/v1/detect", listing, connections=args.soak_connections,
                          threads=args.soak_threads, duration_s=args.soak_minutes * 60, rate=rate, wrk=args.wrk)
    finally:
        stop.set()
        sampler.join()
    row = {"system": server.name, "input": "http-multipart", "part": "soak", "clients": args.soak_connections,
           "gpus": server.gpus, **row, **cpu.result,
           "memory": flatness(samples), "samples": samples, "capacity_req_per_s": capacity}
    row["server_cpu_us_per_request"] = cpu_us_per_request(row)
    if capacity:
        row["served_vs_capacity"] = round(row["req_per_s"] / capacity, 3)
        row["served_ge_90pct_of_capacity"] = row["served_vs_capacity"] >= 0.9
        row["offered_over_capacity"] = round(row["answered_per_s"] / capacity, 2)
    row["pass"] = bool(row["only_200_and_503"] and row["memory"].get("flat_within_5pct")
                       and row.get("served_ge_90pct_of_capacity", False))
    print(f"soak: {row['req_per_s']} req/s served of {rate} offered; {row['statuses']}; memory {row['memory']}",
          flush=True)
    return row


def flatness(samples: list[dict], warmup_fraction: float = 0.1) -> dict:
    """Spread of each memory series after the first 10 % of the run: (max - min) / min."""
    out: dict = {}
    if not samples:
        return out
    horizon = samples[-1]["t_s"]
    steady = [s for s in samples if s["t_s"] >= warmup_fraction * horizon]
    flat = True
    for key in ("pss_bytes", "rss_bytes", "gpu_bytes"):
        vals = [s[key] for s in steady if s.get(key)]
        if len(vals) >= 2:
            spread = (max(vals) - min(vals)) / min(vals)
            out[key] = {"first": vals[0], "min": min(vals), "max": max(vals), "last": vals[-1],
                        "spread_pct": round(100 * spread, 2)}
            if key != "rss_bytes":  # RSS counts shared ring pages once per process mapping them; PSS does not
                flat &= spread <= 0.05
    out["flat_within_5pct"] = flat
    return out


def checks(rows: list[dict]) -> dict:
    """The issue's goals, where the rows measured them (64 and 256 clients)."""
    ours = {r["clients"]: r for r in rows if r["system"] == "yolopipe" and r.get("part") is None}
    naive = {r["clients"]: r for r in rows if r["system"].startswith("naive") and r.get("part") is None}
    out: dict = {}
    if 64 in ours:
        r = ours[64]
        out["c64_ge_4000_req_per_s"] = r["req_per_s"] >= 4000
        out["c64_p99_le_50ms"] = r["p99_ms"] is not None and r["p99_ms"] <= 50
        if 64 in naive and naive[64]["req_per_s"]:
            out["c64_speedup_vs_naive"] = round(r["req_per_s"] / naive[64]["req_per_s"], 1)
            out["c64_ge_14x_naive"] = out["c64_speedup_vs_naive"] >= 14
    grpc = {r["clients"]: r for r in rows if r.get("part") == "grpc"}
    for c in sorted(set(grpc) & set(ours)):
        if ours[c]["req_per_s"] and grpc[c]["req_per_s"] is not None:
            out[f"c{c}_grpc_vs_v1"] = round(grpc[c]["req_per_s"] / ours[c]["req_per_s"], 3)
            out[f"c{c}_grpc_ge_1.2x_v1"] = out[f"c{c}_grpc_vs_v1"] >= 1.2
    oip = {r["clients"]: r for r in rows if r.get("part") == "oip"}
    for c in sorted(set(oip) & set(ours)):
        if ours[c]["req_per_s"]:
            out[f"c{c}_oip_vs_v1"] = round(oip[c]["req_per_s"] / ours[c]["req_per_s"], 3)
            out[f"c{c}_oip_ge_90pct_of_v1"] = out[f"c{c}_oip_vs_v1"] >= 0.9
    if 256 in ours:
        r = ours[256]
        out["c256_ge_5000_req_per_s"] = r["req_per_s"] >= 5000
        out["c256_only_200_and_503"] = r["only_200_and_503"]
        out["c256_p99_of_200s_le_100ms"] = r["p99_ms"] is not None and r["p99_ms"] <= 100
    return out


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="load", help="host,load,soak,kill,sigterm (run in that order)")
    p.add_argument("--images", type=Path, default=None, help="photos to send (default: Ultralytics' assets)")
    p.add_argument("--image-size", default="640x480", help="WxH the photos are cropped and resized to")
    p.add_argument("--max-images", type=int, default=20)
    p.add_argument("--clients", default="64,256", help="closed-loop client counts (connections)")
    p.add_argument("--oip-clients", default="64", help="client counts of the OIP (/v2 infer) rows; '' for none")
    p.add_argument("--grpc-clients", default="64", help="client counts of the gRPC ModelInfer rows; '' for none")
    p.add_argument("--h2load", default=None, help="h2load binary (default: .h2load/ from bench/h2load.sh, else PATH)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per measured row")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of unmeasured load before each row")
    p.add_argument("--wrk", default=None, help="wrk binary (default: .wrk/ from wrk.sh, else PATH)")
    # the yolopipe server
    p.add_argument("--weights", default="sample")
    p.add_argument("--backend", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=None, help="HTTP workers (default: the server's, from the cores; "
                                                              "host: 2)")
    p.add_argument("--grpc-workers", type=int, default=None, help="gRPC workers (default: the server's, as many "
                                                                    "as HTTP workers)")
    p.add_argument("--gpus", default=None, help="'all' or '0,1' (default: the server's, all)")
    p.add_argument("--cpu-workers", type=int, default=None, help="inference workers on a CPU-only run")
    p.add_argument("--queue-budget-s", type=float, default=None)
    p.add_argument("--request-window", type=int, default=None)
    p.add_argument("--ring-mb", type=int, default=None)
    p.add_argument("--standby-wait-s", type=float, default=120.0,
                   help="how long to wait for the warm standbys before measuring (0: do not wait)")
    p.add_argument("--artifacts-dir", type=Path, default=None, help="default: the artifacts store of the cache")
    # the baseline
    p.add_argument("--no-naive", action="store_true")
    p.add_argument("--naive-workers", type=int, default=4, help="uvicorn workers of the naive server")
    p.add_argument("--naive-clients", default=None, help="client counts for the naive server (default: --clients)")
    # host: the host tier with the device emulated, beside reference servers
    p.add_argument("--rate", type=float, default=7000.0, help="host: the emulated device's images/s")
    p.add_argument("--rounds", type=int, default=3, help="host: rounds, each input against yolopipe then its "
                                                          "reference")
    p.add_argument("--round-s", type=float, default=10.0, help="host: seconds per measured row")
    p.add_argument("--host-clients", type=int, default=64, help="host: connections (wrk -c, h2load -c, -m1)")
    p.add_argument("--host-inputs", default=",".join(HOST_INPUTS), help="host: inputs measured")
    p.add_argument("--profile", action="store_true", help="host: then py-spy profiles of each process kind")
    p.add_argument("--profile-rate", type=int, default=200, help="host: py-spy samples per second")
    p.add_argument("--profile-dir", type=Path, default=None, help="host: where py-spy's raw recordings go "
                                                                   "(default: the run's temporary folder)")
    # soak
    p.add_argument("--soak-minutes", type=float, default=10.0)
    p.add_argument("--soak-rate", type=float, default=0.0, help="requests/s (default: 2x the load part's capacity)")
    p.add_argument("--capacity", type=float, default=0.0, help="req/s the soak compares with (default: load part)")
    p.add_argument("--soak-connections", type=int, default=2048)
    p.add_argument("--soak-threads", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=10.0, help="memory sampling interval in the soak")
    p.add_argument("--smoke", action="store_true", help="seconds, not minutes: prove the script runs")
    p.add_argument("--note", default="", help="recorded in the result file")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    args.clients = [int(c) for c in str(args.clients).split(",")]
    args.oip_clients = [int(c) for c in str(args.oip_clients).split(",") if c.strip()]
    args.grpc_clients = [int(c) for c in str(args.grpc_clients).split(",") if c.strip()]
    args.naive_clients = [int(c) for c in str(args.naive_clients).split(",")] if args.naive_clients else args.clients
    args.host_inputs = [x.strip() for x in args.host_inputs.split(",") if x.strip()]
    unknown = set(args.parts) - {"host", "load", "soak", "kill", "sigterm"} or set(args.host_inputs) - set(HOST_INPUTS)
    if unknown:
        p.error(f"unknown parts or host inputs: {', '.join(sorted(unknown))}")
    if args.smoke:
        args.duration, args.warmup, args.soak_minutes, args.sample_s = min(args.duration, 8.0), 2.0, 0.5, 3.0
        args.rounds, args.round_s = 1, min(args.round_s, 3.0)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("YOLO_OFFLINE", "1")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = Path(tempfile.mkdtemp(prefix=f"yolopipe-http-load-{stamp}-"))
    w, h = (int(v) for v in args.image_size.lower().split("x"))
    listing, images = prepare_images(args.images, (w, h), args.max_images, workdir)
    result: dict = {
        "benchmark": "http_load", "smoke": args.smoke, "note": args.note,
        "when": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(), "versions": versions(), "commit": code_revision(), "images": images,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": [],
    }
    rows = result["rows"]
    out = args.out or RESULTS / f"{dt.date.today()}-http-load-{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part: a run cut short by its time limit keeps what it measured
        result["checks"] = {**checks(rows), **result.get("host_tier", {}).get("checks", {})}
        out.write_text(json.dumps(result, indent=2) + "\n")

    if "host" in args.parts:
        run_host(args, listing, workdir, result, save)
        save()
    if not set(args.parts) - {"host"}:
        print(f"checks: {result['checks']}\nwrote {out}")
        return
    # The baseline first: short, and the comparison survives a run that ends early.
    if "load" in args.parts and not args.no_naive:
        naive = start_naive(args, workdir)
        try:
            naive.wait_ready()
            rows += [measure(naive, listing, c, args) for c in args.naive_clients]
        finally:
            naive.stop()
        save()
    started = time.monotonic()
    server = start_yolopipe(args, workdir)
    try:
        server.wait_ready()
        # From the process start to the first 200 of /readyz (with the artifacts of an earlier
        # run present: the restart figure), before any standby is waited for.
        result["yolopipe_ready_s"] = round(time.monotonic() - started, 2)
        import httpx

        wait_for_standbys(server.url, args.standby_wait_s)
        model = httpx.get(f"{server.url}/v1/model", timeout=10).json()
        server.gpus = sum(1 for w in model["serving"]["inference_workers"] if str(w.get("device")).startswith("cuda"))
        model.pop("class_names", None)
        model.get("meta", {}).pop("names", None)
        result["yolopipe_model"] = model
        if "load" in args.parts:
            rows += [measure(server, listing, c, args, target) for target in TARGETS for c in args.clients]
            rows += [measure_oip(server, listing, c, args) for c in args.oip_clients]
            rows += [measure_grpc(server, listing, c, args) for c in args.grpc_clients]
            save()
        if "soak" in args.parts:
            capacity = args.capacity or next((r["req_per_s"] for r in rows if r.get("part") is None
                                              and r["system"] == "yolopipe"), None)
            rate = args.soak_rate or 2 * (capacity or 0)
            if not rate:
                raise SystemExit("--soak needs --soak-rate, --capacity or the load part")
            rows.append(part_soak(server, listing, rate, capacity, args))
            save()
        if "kill" in args.parts:
            rows.append(part_kill(server, listing, args))
            save()
        if "sigterm" in args.parts:
            rows.append(part_sigterm(server, listing, args))
        result["yolopipe_exit_code"] = server.stop()
    finally:
        server.stop()
    save()
    print(f"checks: {result['checks']}\nwrote {out}")


if __name__ == "__main__":
    main()
