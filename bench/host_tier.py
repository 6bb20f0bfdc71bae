"""The host tier with the device emulated (``bench/http_load.py --parts host``): the CPU that
yolopipe's whole server tree spends per answered request, beside reference servers that do the
bare minimum for the same requests, in one run with the rounds interleaved.

* yolopipe: the real server (``bench/emulated_server.py``: supervisor, HTTP and gRPC workers,
  IPC, batcher, formatters) around the emulated device (``bench/emulated_device.py``: a serial
  device at ``--rate`` images/s answering the sample model's real answers, recorded first with
  the CPU model for the benchmark's images);
* references (``bench/reference_servers.py``): a bare FastAPI app on the same uvicorn with as
  many workers, answering fixed bodies of the size of yolopipe's answers, and a bare
  ``grpc.aio`` KServe server in as many processes as yolopipe has gRPC workers, answering fixed
  tensors.

Inputs (``--host-inputs``), each against yolopipe and then its reference, round after round:
``http-multipart`` (``/v1/detect``, multipart), ``http-raw-jpeg`` (``/v1/detect``, raw JPEG
body; reference: ``/v1/detect/raw``), ``http-oip-binary`` (``/v2/models/yolopipe/infer``, binary
tensor extension), ``grpc-model-infer`` (h2load, ``bench/grpc_client.py``). HTTP rows run wrk
with ``--host-clients`` connections (one per thread, as the load rows); gRPC rows h2load with
as many connections, one call in flight each.

Per row: ``server_cpu_us_per_request``, user + system CPU of every process of the server's
tree over the row divided by its OK answers (200s; gRPC OK calls), with req/s and the
percentiles. Per input (``host_tier.summary``): the medians over the rounds and the ratio of
yolopipe's CPU per request to its reference's (``cpu_ratio``; ``cpu_ratio_per_round``).
Each row also splits its CPU by process kind (``cpu_us_per_request_by_process``: yolopipe's
supervisor, HTTP workers, gRPC workers, inference worker, other; a reference's supervisor and
workers). ``--profile``: afterwards, py-spy recordings per input of yolopipe's busy process
kinds and of the reference's worker (``bench/profiles.py``).
"""

from __future__ import annotations

import json
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

from bench.emulated_device import Replay
from bench.grpc_client import PATH as GRPC_PATH
from bench.grpc_client import infer_request, run_h2load
from bench.profiles import record, summarize
from bench.server_meter import ROOT, Server, cpu_us_per_request, metric_samples, wait_for_line, wait_for_standbys
from bench.wrk_client import OIP_SCRIPT, RAW_SCRIPT, SCRIPT, run_wrk

OIP_PATH = "/v2/models/yolopipe/infer"
# input → (yolopipe's path, the reference's path, wrk script); gRPC goes through h2load
WRK_INPUTS: dict[str, tuple[str, str, Path]] = {
    "http-multipart": ("/v1/detect", "/v1/detect", SCRIPT),
    "http-raw-jpeg": ("/v1/detect", "/v1/detect/raw", RAW_SCRIPT),
    "http-oip-binary": (OIP_PATH, OIP_PATH, OIP_SCRIPT),
}
GRPC_INPUT = "grpc-model-infer"
INPUTS = (*WRK_INPUTS, GRPC_INPUT)
# The goals: yolopipe's CPU per request at most its reference's (#49)
CHECKED = ("http-multipart", "http-oip-binary", GRPC_INPUT)


def serving_env(args: Any, **given: Any) -> dict:
    """The environment of a yolopipe server: the serving settings its command line has no option
    for travel as YOLOPIPE_* variables (``given`` over ``args``)."""
    import os

    env = {**os.environ, "YOLO_OFFLINE": "1"}
    if args.artifacts_dir is not None:
        env["YOLOPIPE_ARTIFACTS_DIR"] = str(args.artifacts_dir)
    for name in ("workers", "grpc_workers", "gpus", "queue_budget_s", "request_window", "ring_mb", "cpu_workers"):
        value = given.get(name, getattr(args, name))
        if value not in (None, ""):
            env[f"YOLOPIPE_{name.upper()}"] = str(value)
    return env


# ----------------------------------------------------------------------------- inputs and answers
def record_replay(images: list[bytes], args: Any, out: Path) -> Path:
    """The sample model's answers to ``images``, from the real CPU model, for the emulated device."""
    from app.runtime import OpenOptions, ensure_artifacts, open_model_dir

    started = time.monotonic()
    options = OpenOptions(args.weights, backend="onnxruntime", artifacts_dir=args.artifacts_dir)
    with open_model_dir(ensure_artifacts(options), options) as detector:
        Replay.record(detector, images).save(out)
    print(f"host: the CPU model's answers to {len(images)} images recorded in {time.monotonic() - started:.1f} s",
          flush=True)
    return out


def oip_request(image: bytes) -> tuple[bytes, dict[str, str]]:
    """One image as ``bench/wrk/oip.lua`` posts it: Triton's binary tensor data."""
    tensor = struct.pack("<I", len(image)) + image
    header = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(tensor)}}],
                         "parameters": {"binary_data_output": True}}, separators=(",", ":")).encode()
    return header + tensor, {"content-type": "application/octet-stream",
                             "inference-header-content-length": str(len(header))}


def capture_answers(server: Server, paths: list[Path], folder: Path) -> dict:
    """yolopipe's answers to every image, per protocol; the reference answers with the one of
    median size (gRPC: the answer to the image h2load sends). Writes the reference's files."""
    import grpc
    import httpx

    folder.mkdir(parents=True, exist_ok=True)
    answers: dict[str, list[bytes]] = {"v1": [], "v1-raw": [], "oip": []}
    oip_headers: list[dict] = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path in paths:
            data = path.read_bytes()
            got = [http.post("/v1/detect", files={"image": (path.name, data, "image/jpeg")}),
                   http.post("/v1/detect", content=data, headers={"content-type": "image/jpeg"}),
                   http.post(OIP_PATH, content=oip_request(data)[0], headers=oip_request(data)[1])]
            for r in got:
                if r.status_code != 200:
                    raise SystemExit(f"yolopipe answered {r.status_code} to {r.request.url}: {r.text[:500]}")
            for key, r in zip(answers, got):
                answers[key].append(r.content)
            oip_headers.append({k: got[2].headers[k] for k in ("content-type", "inference-header-content-length")})
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        grpc_answer = channel.unary_unary(GRPC_PATH)(infer_request(paths[0].read_bytes()), timeout=60)
    info = {}
    for key, bodies in answers.items():
        k = sorted(range(len(bodies)), key=lambda i: len(bodies[i]))[len(bodies) // 2]
        (folder / ("oip.bin" if key == "oip" else f"{key}.json")).write_bytes(bodies[k])
        if key == "oip":
            (folder / "oip.headers.json").write_text(json.dumps(oip_headers[k]))
        info[key] = {"yolopipe_mean_bytes": round(statistics.mean(map(len, bodies))), "reference_bytes": len(bodies[k])}
    (folder / "grpc.bin").write_bytes(grpc_answer)
    info["grpc"] = {"yolopipe_bytes": len(grpc_answer), "reference_bytes": len(grpc_answer)}
    return info


def check_references(http: Server, grpc_server: Server, image: Path, folder: Path) -> None:
    """Each reference route answers one request of its row with its fixed answer."""
    import grpc
    import httpx

    data = image.read_bytes()
    expected = {"/v1/detect": "v1.json", "/v1/detect/raw": "v1-raw.json", OIP_PATH: "oip.bin"}
    with httpx.Client(base_url=http.url, timeout=60) as client:
        got = {"/v1/detect": client.post("/v1/detect", files={"image": (image.name, data, "image/jpeg")}),
               "/v1/detect/raw": client.post("/v1/detect/raw", content=data, headers={"content-type": "image/jpeg"}),
               OIP_PATH: client.post(OIP_PATH, content=oip_request(data)[0], headers=oip_request(data)[1])}
    for path, r in got.items():
        if r.status_code != 200 or r.content != (folder / expected[path]).read_bytes():
            raise SystemExit(f"the reference answered {r.status_code} to {path}: {r.text[:300]}")
    with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as channel:
        if channel.unary_unary(GRPC_PATH)(infer_request(data), timeout=60) != (folder / "grpc.bin").read_bytes():
            raise SystemExit("the reference gRPC server answered something else")


# ----------------------------------------------------------------------------- servers
def start_emulated(args: Any, replay: Path, workers: int, grpc_workers: int, logdir: Path) -> Server:
    cmd = [sys.executable, str(ROOT / "bench" / "emulated_server.py"), "--replay", str(replay), "--rate", str(args.rate),
           "--port", "{port}", "--grpc-port", "{grpc_port}", "--max-batch", str(args.max_batch),
           "--max-wait-ms", str(args.max_wait_ms)]
    env = serving_env(args, workers=workers, grpc_workers=grpc_workers)
    return Server(f"yolopipe-emulated-{args.rate:g}", cmd, env, logdir / "yolopipe_emulated.log")


def start_references(answers: Path, workers: int, grpc_workers: int, logdir: Path) -> tuple[Server, Server]:
    import os

    script = str(ROOT / "bench" / "reference_servers.py")
    http = Server(f"fastapi-bare-{workers}w", [sys.executable, script, "http", "--answers", str(answers),
                                               "--port", "{port}", "--workers", str(workers)],
                  dict(os.environ), logdir / "reference_http.log")
    grpc = Server(f"grpc-aio-bare-{grpc_workers}p", [sys.executable, script, "grpc", "--answers", str(answers),
                                                     "--port", "{port}", "--processes", str(grpc_workers)],
                  dict(os.environ), logdir / "reference_grpc.log")
    return http, grpc


# ----------------------------------------------------------------------------- rows
def load(server: Server, name: str, reference: bool, listing: Path, args: Any, seconds: float) -> dict:
    """One closed-loop run of input ``name`` against ``server`` (yolopipe's, or a reference)."""
    if name == GRPC_INPUT:
        image = Path(listing.read_text().split()[0]).read_bytes()
        port, metrics = (server.port, None) if reference else (server.grpc_port, f"{server.url}/metrics")
        return run_h2load("127.0.0.1", port, image, clients=args.host_clients, duration_s=seconds,
                          metrics_url=metrics, h2load=args.h2load)
    ours, theirs, script = WRK_INPUTS[name]
    return run_wrk(server.url + (theirs if reference else ours), listing, connections=args.host_clients,
                   duration_s=seconds, wrk=args.wrk, script=script)


def batches_formed(server: Server) -> tuple[float, float]:
    """The inference workers' batches and the images in them so far (/metrics)."""
    found = {"yolopipe_batch_size_count": 0.0, "yolopipe_batch_size_sum": 0.0}
    for sample in metric_samples(f"{server.url}/metrics"):
        if sample.name in found:
            found[sample.name] += sample.value
    return found["yolopipe_batch_size_count"], found["yolopipe_batch_size_sum"]


def measure(server: Server, kinds: dict[int, str], name: str, reference: bool, listing: Path, args: Any,
            round_no: int) -> dict:
    before = None if reference else batches_formed(server)
    with server.meter.cpu() as cpu:
        row = load(server, name, reference, listing, args, args.round_s)
    if before is not None:  # the batches the row made: their size sets the batcher's share of each request
        batches, images = (a - b for a, b in zip(batches_formed(server), before))
        row["batches"], row["mean_batch"] = int(batches), round(images / batches, 2) if batches else None
    row = {"system": server.name, "input": name, "part": "host", "round": round_no, "reference": reference,
           "gpus": 0, **row, **cpu.result}
    row["server_cpu_us_per_request"] = cpu_us_per_request(row)
    by_kind: dict[str, float] = {}
    for pid, seconds in cpu.by_pid.items():
        kind = kinds.get(pid, "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    if row["answers_ok"]:  # where it went: each kind of process, all its processes together
        row["cpu_us_per_request_by_process"] = {k: round(v / row["answers_ok"] * 1e6, 1) for k, v in
                                                sorted(by_kind.items(), key=lambda kv: -kv[1])}
    print(f"host r{round_no} {server.name:>24} {name:<17} {row['req_per_s']:>8.1f} req/s  p50 {row['p50_ms']} ms  "
          f"p99 {row['p99_ms']} ms  cpu {row['server_cpu_us_per_request']} µs/request "
          f"({row['server_cpu_cores']} cores)" + (f", mean batch {row['mean_batch']}" if "mean_batch" in row else ""),
          flush=True)
    return row


def summarize_rows(rows: list[dict], inputs: list[str]) -> tuple[dict, dict]:
    """Per input: each side's medians over the rounds and the CPU ratio; and the checks."""
    def side(rs: list[dict]) -> dict:
        def median(key: str) -> float | None:
            values = [r[key] for r in rs if r.get(key) is not None]
            return round(statistics.median(values), 2) if values else None

        kinds = sorted({k for r in rs for k in r.get("cpu_us_per_request_by_process", {})})
        by_process = {k: round(statistics.median(r["cpu_us_per_request_by_process"].get(k, 0.0) for r in rs
                                                 if "cpu_us_per_request_by_process" in r), 1) for k in kinds}
        return {"system": rs[0]["system"] if rs else None, "rounds": len(rs),
                "cpu_us_per_request": median("server_cpu_us_per_request"), "req_per_s": median("req_per_s"),
                "p50_ms": median("p50_ms"), "p99_ms": median("p99_ms"), "server_cpu_cores": median("server_cpu_cores"),
                "cpu_us_per_request_by_process": by_process}

    summary, checks = {}, {}
    for name in inputs:
        ours = [r for r in rows if r["input"] == name and not r["reference"]]
        refs = [r for r in rows if r["input"] == name and r["reference"]]
        entry = {"yolopipe": side(ours), "reference": side(refs)}
        a, b = entry["yolopipe"]["cpu_us_per_request"], entry["reference"]["cpu_us_per_request"]
        entry["cpu_ratio"] = round(a / b, 2) if a and b else None
        entry["cpu_ratio_per_round"] = [
            round(o["server_cpu_us_per_request"] / r["server_cpu_us_per_request"], 2)
            if o.get("server_cpu_us_per_request") and r.get("server_cpu_us_per_request") else None
            for o, r in zip(ours, refs)]
        summary[name] = entry
        if name in CHECKED and entry["cpu_ratio"] is not None:
            checks[f"host_{name}_cpu_vs_reference"] = entry["cpu_ratio"]
            checks[f"host_{name}_cpu_le_1x_reference"] = entry["cpu_ratio"] <= 1.0
    return summary, checks


# ----------------------------------------------------------------------------- profiles
def process_kinds(server: Server, reference: bool) -> dict[int, str]:
    """Each process of a server's tree by kind. yolopipe: ``supervisor``, ``http_worker`` and
    ``grpc_worker`` (by the port each listens on), ``inference_worker`` (its pid from /v1/model),
    ``other`` (the warm standby, multiprocessing's helpers); a reference: ``supervisor``,
    ``worker`` (listening on its port), ``other``."""
    import httpx
    import psutil

    kinds = {server.proc.pid: "supervisor"}
    inference = set() if reference else {
        w["pid"] for w in httpx.get(f"{server.url}/v1/model", timeout=10).json()["serving"]["inference_workers"]}
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        connections = getattr(child, "net_connections", None) or child.connections  # psutil < 6 names it so
        ports = {c.laddr.port for c in connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        if reference:
            kinds[child.pid] = "worker" if server.port in ports else "other"
        else:
            kinds[child.pid] = ("inference_worker" if child.pid in inference else "http_worker" if server.port in ports
                                else "grpc_worker" if server.grpc_port in ports else "other")
    return kinds


def profile(servers: dict[str, Server], kinds: dict[int, str], inputs: list[str], listing: Path, args: Any,
            folder: Path) -> dict:
    """Per input, py-spy recordings (``bench/profiles.py``: the active and the GIL view) of one
    process of each kind it keeps busy, under the same load as the rows (not metered): yolopipe's
    front-end worker and inference worker, then the reference's worker. ``servers``: yolopipe's
    (``ours``) and each input's reference (by input)."""
    folder.mkdir(parents=True, exist_ok=True)
    out: dict = {"rate_hz": args.profile_rate, "folder": str(folder)}
    for name in inputs:
        front = "grpc_worker" if name == GRPC_INPUT else "http_worker"
        out[name] = {}
        for side, server, wanted in (("yolopipe", servers["ours"], (front, "inference_worker")),
                                     ("reference", servers[name], ("worker",))):
            tree = set(server.meter.tree_pids())
            mine = {pid: kind for pid, kind in kinds.items() if pid in tree}
            pid_of = {kind: min(p for p, k in mine.items() if k == kind) for kind in wanted}
            raws = {(kind, view): folder / f"{name}-{side}-{kind}-{view}.txt" for kind in wanted
                    for view in ("active", "gil")}
            spies = {key: record(pid_of[key[0]], args.round_s, raw, args.profile_rate, gil=key[1] == "gil")
                     for key, raw in raws.items()}
            before = {kind: _cpu_s(pid) for kind, pid in pid_of.items()}
            row = load(server, name, side == "reference", listing, args, args.round_s + 1)
            recordings: dict = {}
            for kind, pid in pid_of.items():
                # this process's CPU per answer it gave (the run's answers shared by the processes
                # of its kind): what its samples' shares divide
                handled = row["answers_ok"] / sum(1 for k in mine.values() if k == kind)
                recordings[kind] = {"pid": pid, "cpu_us_per_request": round(
                    (_cpu_s(pid) - before[kind]) / handled * 1e6, 1) if handled else None}
            for (kind, view), spy in spies.items():
                _, err = spy.communicate(timeout=120)
                raw = raws[(kind, view)]
                recordings[kind][view] = summarize(raw, ROOT) if raw.exists() else {"error": err.decode()[-500:]}
            out[name][side] = recordings
            print(f"host profile {name} {side}: " + "; ".join(
                f"{kind} {r['cpu_us_per_request']} µs/request, top holding the GIL "
                f"{next(iter(r['gil'].get('self_percent', {})), None)}" for kind, r in recordings.items()), flush=True)
    return out


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


# ----------------------------------------------------------------------------- the part
def run_host(args: Any, listing: Path, workdir: Path, result: dict, save: Any) -> None:
    """Record the replay, start yolopipe (device emulated) and both references, measure every
    input round after round (yolopipe, then its reference), summarize, profile if asked."""
    paths = [Path(p) for p in listing.read_text().split()]
    replay = record_replay([p.read_bytes() for p in paths], args, workdir / "replay.npz")
    workers = args.workers or 2
    grpc_workers = args.grpc_workers or workers
    inputs = list(args.host_inputs)
    host: dict = result.setdefault("host_tier", {})
    host["config"] = {"rate_images_per_s": args.rate, "http_workers": workers, "grpc_workers": grpc_workers,
                      "clients": args.host_clients, "rounds": args.rounds, "round_s": args.round_s,
                      "warmup_s": args.warmup, "inputs": inputs, "max_batch": args.max_batch,
                      "max_wait_ms": args.max_wait_ms, "inference_workers": 1}
    ours = start_emulated(args, replay, workers, grpc_workers, workdir)
    servers = [ours]
    try:
        ours.wait_ready(300)
        wait_for_standbys(ours.url, args.standby_wait_s)
        host["answers"] = capture_answers(ours, paths, workdir / "answers")
        ref_http, ref_grpc = start_references(workdir / "answers", workers, grpc_workers, workdir)
        servers += [ref_http, ref_grpc]
        ref_http.wait_ready(120)
        wait_for_line("ready", ref_grpc.proc, ref_grpc.log, 120)
        check_references(ref_http, ref_grpc, paths[0], workdir / "answers")
        reference = {name: ref_grpc if name == GRPC_INPUT else ref_http for name in inputs}
        kinds = {**process_kinds(ours, False), **process_kinds(ref_http, True), **process_kinds(ref_grpc, True)}
        if args.warmup > 0:  # once, before the first round
            for name in inputs:
                load(ours, name, False, listing, args, args.warmup)
                load(reference[name], name, True, listing, args, args.warmup)
        rows = result["rows"]
        for round_no in range(1, args.rounds + 1):
            for name in inputs:
                rows.append(measure(ours, kinds, name, False, listing, args, round_no))
                rows.append(measure(reference[name], kinds, name, True, listing, args, round_no))
            host["summary"], host["checks"] = summarize_rows([r for r in rows if r.get("part") == "host"], inputs)
            save()
        for name, entry in host["summary"].items():
            print(f"host {name:<17} yolopipe {entry['yolopipe']['cpu_us_per_request']} µs/request, "
                  f"reference {entry['reference']['cpu_us_per_request']}: {entry['cpu_ratio']}x "
                  f"(per round {entry['cpu_ratio_per_round']})", flush=True)
        if args.profile:
            host["profiles"] = profile({"ours": ours, **reference}, kinds, inputs, listing, args,
                                       args.profile_dir or workdir / "profiles")
            save()
    finally:
        for server in servers:
            server.stop()
