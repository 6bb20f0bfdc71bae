"""Memory after bursts (issues #30, #49): does ``yolopipe serve`` give back what a burst took?

A server started and warmed up, its process tree at rest, then each burst (``batch32``,
``pipelined40``, ``concurrent500``), the tree's RSS and PSS sampled until ``--settle-s`` after its
last response; exit status 1 when a burst did not come back within ``--tolerance`` of rest.
``--config``: the bursts against servers of several configurations in turn. ``--engine-sweep``:
ONNX Runtime alone, a fresh process per batch size and memory options. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from bench.server_meter import ServerMeter, free_port, wait_for_standbys, wait_ready

MB = 1 << 20
BURSTS = ("batch32", "pipelined40", "concurrent500")
ORT_OPTIONS = {"arena+pattern": (True, True), "arena": (True, False), "pattern": (False, True), "none": (False, False)}


def proc_bytes(pid: int, name: str, field: str) -> int:  # 0 for a process gone
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), 0)
    except (OSError, ValueError):
        return 0


def rss_bytes(pid: int) -> int:
    return proc_bytes(pid, "status", "VmRSS")


def pss_bytes(pid: int) -> int:  # each shared page split among its mappers: a sum counts it once
    return proc_bytes(pid, "smaps_rollup", "Pss")


def gpu_bytes_by_pid() -> dict[int, int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return {}
    rows = [[int(v) for v in line.split(",")] for line in out.splitlines() if re.fullmatch(r"\d+, *\d+", line.strip())]
    return {pid: sum(mib * MB for p, mib in rows if p == pid) for pid, _ in rows}


class Tree:
    """The server's processes, by role, and snapshots of their memory."""

    def __init__(self, root: int, port: int) -> None:
        self.root, self.port, self.url = root, port, f"http://127.0.0.1:{port}"
        self.refresh()

    def workers(self) -> list[dict]:
        import httpx

        return httpx.get(f"{self.url}/v1/model", timeout=10).json()["serving"]["inference_workers"]

    def refresh(self) -> None:
        """pid → supervisor, http (listens on the port), grpc (elsewhere), inference, standby, resource-tracker."""
        import psutil

        inference = {w["pid"] for w in self.workers() if w.get("pid")}
        self.roles = {self.root: "supervisor"}
        for pid in self.pids()[1:]:
            try:
                p = psutil.Process(pid)
                connections = getattr(p, "net_connections", None) or p.connections  # psutil < 6 names it so
                listens = {c.laddr.port for c in connections("tcp") if c.status == psutil.CONN_LISTEN}
                tracker = "resource_tracker" in " ".join(p.cmdline())
            except psutil.Error:
                continue
            self.roles[pid] = ("resource-tracker" if tracker else "inference" if pid in inference
                               else "http" if self.port in listens else "grpc" if listens else "standby")

    def pids(self) -> list[int]:
        return ServerMeter(self.root).tree_pids()

    def rss_mb(self) -> float:
        return sum(rss_bytes(pid) for pid in self.pids()) / MB

    def snapshot(self) -> dict:
        gpu = gpu_bytes_by_pid()
        procs = [{"pid": pid, "role": role, "rss_mb": round(rss_bytes(pid) / MB, 1),
                  **({"gpu_mb": round(gpu[pid] / MB, 1)} if pid in gpu else {})}
                 for pid, role in sorted(self.roles.items(), key=lambda kv: kv[1])]
        out = {"tree_rss_mb": round(sum(p["rss_mb"] for p in procs), 1), "processes": procs}
        if gpu:
            out["gpu_mb"] = round(sum(gpu.get(pid, 0) for pid in self.roles) / MB, 1)
        return out


@contextmanager
def peaks(pids: Callable[[], list[int]], period: float, *, pss: bool = True) -> Iterator[dict[str, int]]:
    """The peaks of the summed RSS (and PSS) of ``pids()`` every ``period`` s (listed every 0.5 s)."""
    found, stop = {"rss": 0, "pss": 0}, threading.Event()

    def sample() -> None:
        listed_at, now = time.monotonic(), pids()
        while not stop.wait(period):
            if time.monotonic() - listed_at > 0.5:
                listed_at, now = time.monotonic(), pids()
            found["rss"] = max(found["rss"], sum(rss_bytes(pid) for pid in now))
            if pss:
                found["pss"] = max(found["pss"], sum(pss_bytes(pid) for pid in now))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join()


def gather(coroutines: Iterable[Coroutine]) -> list:
    async def run() -> list:
        return await asyncio.gather(*coroutines)

    return asyncio.run(run())


def http_request(path: str, body: bytes, content_type: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def statuses(port: int, requests: list[bytes], timeout: float = 900.0) -> dict[str, int]:
    """Each request on its own connection, all at once, each response read to the end (written
    whole before reading: a 503 sent before the body was read still counts); statuses by count."""

    async def exchange(request: bytes) -> int | None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
        except (OSError, asyncio.TimeoutError):
            return None
        try:
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
            status = int(head.split(b" ", 2)[1])
            length = re.search(rb"(?i)content-length:\s*(\d+)", head)
            if length:
                await asyncio.wait_for(reader.readexactly(int(length.group(1))), timeout)
            return status
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
            return None
        finally:
            writer.close()

    found = [str(s) if s is not None else "no-answer" for s in gather(exchange(r) for r in requests)]
    return {key: found.count(key) for key in dict.fromkeys(found)}


def pipelined(port: int, request: bytes, clients: int = 40, requests: int = 8, linger_s: float = 3.0) -> dict:
    """Each client writes ``requests`` requests back to back, reads nothing, and after ``linger_s``
    closes its socket with a reset (it vanishes); what reached the server's side, in all."""

    async def vanish() -> int:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.pause_reading()  # not even the transport reads
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the answers pile up on the server's side
        writer.write(request * requests)
        await asyncio.sleep(linger_s)
        sent = len(request) * requests - writer.transport.get_write_buffer_size()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset on close
        writer.transport.abort()
        return sent

    written = sum(gather(vanish() for _ in range(clients)))
    return {"bytes_written": written, "requests_written": written // len(request)}


def run_burst(tree: Tree, name: str, photo: bytes, rest: dict, args: argparse.Namespace) -> dict:
    """One burst, and the tree watched until ``--settle-s`` after its last response."""
    rest_mb, single, tolerance = rest["tree_rss_mb"], http_request("/v1/detect", photo, "image/jpeg"), args.tolerance
    before_mb, t0 = round(tree.rss_mb(), 1), time.monotonic()
    with peaks(tree.pids, args.sample_ms / 1e3) as peak:
        if name == "batch32":
            body = b"".join(b"--b\r\ncontent-disposition: form-data; name=\"images\"; filename=\"%d.jpg\"\r\n"
                            b"content-type: image/jpeg\r\n\r\n%b\r\n" % (i, photo) for i in range(args.copies))
            outcome = {"statuses": statuses(tree.port, [http_request("/v1/detect/batch", body + b"--b--\r\n",
                                                                     "multipart/form-data; boundary=b")])}
            outcome["images"] = args.copies if outcome["statuses"] == {"200": 1} else 0
        elif name == "concurrent500":
            outcome = {"statuses": statuses(tree.port, [single] * args.clients)}
            outcome["images"] = outcome["statuses"].get("200", 0)
        elif name == "pipelined40":
            outcome = pipelined(tree.port, single)
        else:
            raise SystemExit(f"unknown burst {name!r}; choose from {', '.join(BURSTS)}")
        while sum(w["queued_images"] for w in tree.workers()):  # vanished clients: over when the queues are empty
            time.sleep(0.1)
        last = time.monotonic()
        at_last, series, back_at, still = tree.snapshot(), [], None, False
        # Back, and still for a second: each process gives back on its own quiet clock, so the
        # first sample within the tolerance can come between two of their releases.
        while time.monotonic() - last < args.settle_s and not (still and args.until_back):
            time.sleep(0.5)
            series.append((round(time.monotonic() - last, 2), round(tree.rss_mb(), 1)))
            if back_at is None and series[-1][1] <= rest_mb * (1 + tolerance):
                back_at = series[-1][0]
            recent = [mb for _, mb in series[-3:]]
            still = back_at is not None and len(recent) == 3 and max(recent) - min(recent) <= 0.01 * rest_mb
        watched, settled = time.monotonic() - last, tree.snapshot()
    row = {"burst": name, **outcome, "seconds": round(last - t0, 2), "rest_mb": rest_mb,
           "rest_pss_mb": rest["tree_pss_mb"], "before_mb": before_mb, "peak_mb": round(peak['rss'] / MB, 1),
           "peak_over_rest_mb": round(peak['rss'] / MB - rest_mb, 1),
           "peak_pss_over_rest_mb": round(peak['pss'] / MB - rest["tree_pss_mb"], 1),
           "at_last_response_mb": at_last["tree_rss_mb"], "settled_mb": settled["tree_rss_mb"],
           "settle_s": round(watched, 2), "back_within_tolerance_after_s": back_at,
           "returned": settled["tree_rss_mb"] <= rest_mb * (1 + tolerance), "series_mb": series,
           "at_last_response": at_last, "settled": settled}
    if "images" in outcome:
        row["images_per_s"] = round(outcome["images"] / (last - t0), 3)
    if "gpu_mb" in settled and "gpu_mb" in rest:  # device memory back to rest too
        row.update(gpu_rest_mb=rest["gpu_mb"], gpu_at_last_response_mb=at_last["gpu_mb"], gpu_settled_mb=settled["gpu_mb"])
        row["returned"] = row["returned"] and settled["gpu_mb"] <= rest["gpu_mb"] * (1 + tolerance)
    print(f"{name:>14}: {' '.join(f'{k} {row[k]}' for k in row if k.endswith(('_mb', '_s')) and k != 'series_mb')}"
          f"  {outcome}", flush=True)
    return row


def start_server(args: argparse.Namespace, env: list[str], code: str | None, log: Path) -> tuple[subprocess.Popen, int]:
    """``yolopipe serve`` of the checkout ``code`` (default this one): ready, standbys warm, warmed up."""
    import httpx

    port, code_dir = free_port(), Path(code or ROOT).resolve()
    # gRPC workers (where the server has them) on a free port, not the shared default
    environ = {**os.environ, "YOLO_OFFLINE": "1", "PYTHONPATH": str(code_dir), "YOLOPIPE_GRPC_PORT": str(free_port()),
               **dict(kv.split("=", 1) for kv in env)}
    cmd = [sys.executable, "-m", "app.cli", "serve", "--weights", args.weights, "--backend", args.backend,
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=environ, cwd=code_dir,
                            start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, args.ready_timeout_s)
        wait_for_standbys(f"http://127.0.0.1:{port}", args.ready_timeout_s)
        for _ in range(args.warmup):
            httpx.post(f"http://127.0.0.1:{port}/v1/detect", content=bus_jpg().read_bytes(),
                       headers={"content-type": "image/jpeg"}, timeout=60)
    except BaseException:
        stop_server(proc)
        raise
    return proc, port


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bus_jpg() -> Path:
    return Path(importlib.util.find_spec("ultralytics").origin).parent / "assets" / "bus.jpg"


def summarize(rows: list[dict], keys: tuple[str, ...], columns: dict[str, Callable]) -> list[dict]:
    """Per group of ``keys`` (in the rows' order), each column's values folded by its function; printed."""
    summary = []
    for group in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
        mine = [r for r in rows if tuple(r[k] for k in keys) == group]
        summary.append({**dict(zip(keys, group)), **{c: round(fold(r.get(c) or 0 for r in mine), 3) for c, fold in columns.items()}})
        print("  ".join(f"{k} {v}" for k, v in summary[-1].items()), flush=True)
    return summary


def bursts(args: argparse.Namespace) -> dict:
    """The probe: one server, its rest measured once after the warm-up. With ``--config NAME=TOKEN
    ...`` (each token ``VAR=VALUE`` for the server's environment or ``@DIR`` for the checkout it
    runs): a server per configuration, all started first, the bursts against each in turn (the
    order turned each round), each burst's rest measured just before it."""
    import httpx

    from app.benchmark.machine import code_revision, machine_info, versions

    configs = [] if args.config else [("", [], args.code)]  # (name, environment, checkout)
    for text in args.config:
        name, _, spec = text.partition("=")
        env, dirs = [t for t in spec.split() if t[0] != "@"], [t[1:] for t in spec.split() if t[0] == "@"]
        if not name or any("=" not in t for t in env):
            raise SystemExit(f"--config {text!r}: NAME=VAR=VALUE ... or NAME=@DIR ...")
        configs.append((name, env, dirs[0] if dirs else args.code))
    photo, logs = bus_jpg().read_bytes(), Path(tempfile.mkdtemp(prefix="yolopipe-memory-"))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    rests: dict[str, dict] = {}
    rows = []
    try:
        for name, env, code in configs:
            servers[name] = start_server(args, [*args.env, *env], code, logs / f"server{name}.log")
            print(f"{name or 'server'}: ready on port {servers[name][1]}", *env, code or "", flush=True)
        for k in range(args.rounds):
            for name, _, _ in configs[k % len(configs):] + configs[: k % len(configs)]:
                tree = Tree(servers[name][0].pid, servers[name][1])
                for burst in args.bursts:
                    if args.config or name not in rests:
                        time.sleep(args.rest_s)
                        tree.refresh()
                        pss = sum(pss_bytes(pid) for pid in tree.pids()) / MB
                        rests[name] = {**tree.snapshot(), "tree_pss_mb": round(pss, 1)}
                        print(f"[{name or 'server'}, round {k + 1}] rest:", rests[name], flush=True)
                    tree.refresh()
                    rows.append({**({"config": name} if args.config else {}), "round": k + 1,
                                 **run_burst(tree, burst, photo, rests[name], args)})
        model = httpx.get(f"http://127.0.0.1:{servers[configs[0][0]][1]}/v1/model", timeout=10).json()
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    config = {key: vars(args)[key] for key in ("backend", "weights", "env", "warmup", "settle_s", "tolerance", "rounds",
                                               "copies", "clients", "sample_ms")}
    result = {"machine": machine_info(), "versions": versions(), "commit": code_revision(),
              "config": {"date": dt.datetime.now().isoformat(timespec="seconds"), **config, "configs": args.config,
                         "photo_bytes": len(photo),
                         "server_code": str(Path(args.code or ROOT).resolve()), "model": model}}
    if args.config:
        summary = summarize(rows, ("config", "burst"), {"peak_over_rest_mb": max, "peak_pss_over_rest_mb": max,
                                                        "images_per_s": statistics.median})
        for line in summary:
            line.update(next({"env": env, "code": code} for name, env, code in configs if name == line["config"]))
        return {**result, "rows": rows, "summary": summary}
    return {**result, "rest": rests[""], "bursts": rows, "returned": all(r["returned"] for r in rows)}


def engine_child(model: str, batch: int, options: str, threads: int, runs: int, photo: str) -> dict:
    """One ONNX Runtime configuration in this fresh process, the server's backend class on ``batch``
    copies of ``photo``: the resident peak over rest (every 5 ms), wall and CPU time of ``runs`` runs."""
    import cv2
    import numpy as np

    from app.backends.onnxruntime import OnnxRuntimeBackend
    from app.imaging.letterbox import letterbox, to_input

    arena, pattern = ORT_OPTIONS[options]
    backend = OnnxRuntimeBackend(Path(model), threads=threads or None, memory_arena=arena, memory_pattern=pattern)
    image = cv2.imdecode(np.frombuffer(Path(photo).read_bytes(), np.uint8), cv2.IMREAD_COLOR)
    x = to_input([letterbox(image, 640)[0]] * batch)
    rest, wall, cpu = rss_bytes(os.getpid()), [], []
    with peaks(lambda: [os.getpid()], 0.005, pss=False) as peak:
        backend.infer(x)
        for _ in range(runs):
            t0, c0 = time.perf_counter(), time.process_time()
            backend.infer(x)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"batch": batch, "ort": options, "peak_over_rest_mb": round((max(peak["rss"], rest) - rest) / MB, 1),
            "images_per_s": round(batch * runs / sum(wall), 3), "best_images_per_s": round(batch / min(wall), 3),
            "cpu_ms_per_image": round(1e3 * sum(cpu) / (batch * runs), 1)}


def engine_sweep(args: argparse.Namespace) -> dict:
    """Every (batch, ONNX Runtime options) pair, each in a fresh process, the pairs interleaved
    over ``--rounds`` (the order turned each round), so that a machine's drift falls on all."""
    from app.benchmark.machine import code_revision, machine_info, versions
    from app.builder.export import export_onnx

    model, photo = str(export_onnx("sample").onnx_path), str(bus_jpg())
    pairs = [(b, o) for b in args.batches for o in args.ort]
    code = ("import json, sys; from bench.memory_probe import engine_child; a = sys.argv; "
            "print(json.dumps(engine_child(a[1], int(a[2]), a[3], int(a[4]), int(a[5]), a[6])))")
    rows = []
    for k in range(args.rounds):
        for batch, options in pairs[k % len(pairs):] + pairs[: k % len(pairs)]:
            out = subprocess.run([sys.executable, "-c", code, model, str(batch), options, str(args.ort_threads),
                                  str(args.runs), photo], cwd=ROOT, capture_output=True, text=True, check=False,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            if out.returncode:
                raise SystemExit(f"batch {batch}, {options}: exit {out.returncode}\n{out.stderr[-3000:]}")
            rows.append({"round": k + 1, **json.loads(out.stdout.strip().splitlines()[-1])})
            print(rows[-1], flush=True)
    # On a shared machine the best run is the least disturbed one: its rate is the cleaner figure.
    summary = summarize(rows, ("batch", "ort"), {"peak_over_rest_mb": max, "images_per_s": statistics.median,
                                                 "best_images_per_s": max, "cpu_ms_per_image": statistics.median})
    return {"machine": machine_info(), "versions": versions(), "commit": code_revision(),
            "config": {"date": dt.datetime.now().isoformat(timespec="seconds"), "model": model, "photo": photo,
                       "rounds": args.rounds, "runs": args.runs, "ort_threads": args.ort_threads},
            "rows": rows, "summary": summary}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bursts", type=lambda s: s.split(","), default=list(BURSTS), help="comma-separated, in order")
    p.add_argument("--weights", default="sample")
    p.add_argument("--backend", default="onnxruntime", help="auto on a GPU server")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the server (repeatable)")
    p.add_argument("--code", help="the checkout whose server runs (default: this one), e.g. a baseline's")
    p.add_argument("--rounds", type=int, default=1, help="run the bursts this many times (a slow climb shows)")
    p.add_argument("--copies", type=int, default=32, help="images of the batch32 burst's one request")
    p.add_argument("--clients", type=int, default=500, help="requests of the concurrent500 burst")
    p.add_argument("--sample-ms", type=float, default=20.0, help="the tree's RSS and PSS sampled this often")
    p.add_argument("--warmup", type=int, default=5, help="single requests before rest is measured")
    p.add_argument("--rest-s", type=float, default=3.0, help="pause before rest is measured")
    p.add_argument("--settle-s", type=float, default=10.0, help="seconds watched after each burst's last response")
    p.add_argument("--tolerance", type=float, default=0.10, help="back within this fraction of rest")
    p.add_argument("--until-back", action="store_true", help="stop watching once back and still (--settle-s: a deadline)")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--config", action="append", default=[], metavar="NAME=VAR=VALUE ...|@DIR", help="repeatable")
    p.add_argument("--engine-sweep", action="store_true", help="ONNX Runtime alone: each of --batches × --ort")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 4, 8, 16])
    p.add_argument("--ort", type=lambda s: s.split(","), default=["arena+pattern", "arena"],
                   help=f"--engine-sweep: ONNX Runtime's memory options ({', '.join(ORT_OPTIONS)})")
    p.add_argument("--runs", type=int, default=3, help="--engine-sweep: timed runs per configuration and round")
    p.add_argument("--ort-threads", type=int, default=0, help="--engine-sweep: intra-op threads (0: every core)")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = engine_sweep(args) if args.engine_sweep else bursts(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if result.get("returned", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
