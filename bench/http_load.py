"""HTTP load benchmark: yolopipe's server vs the naive Ultralytics-per-request server, same run.

Closed loop (default): N concurrent asyncio clients, spread over P client processes (one
Python process tops out at a few thousand requests/s; use several at high rates), each
POSTing real JPEGs from a folder as raw ``image/jpeg`` bodies for a fixed duration or until
a request budget is spent. Reports req/s, p50/p95/p99 latency and errors by status.

Soak (``--soak MINUTES --rate R``): open loop at a fixed rate for N minutes (a rate above
capacity should give only 503s beyond it), sampling the server's RSS and GPU memory at
intervals; memory must stay flat within 5 %.

    python bench/http_load.py --images /data/photos --clients 64 --procs 4 --duration 30 \\
        --backend tensorrt --naive-workers 1,4
    python bench/http_load.py --target http://127.0.0.1:8000 --no-naive --clients 8 --duration 5
    python bench/http_load.py --soak 10 --rate 3000 --backend tensorrt --no-naive

Results: JSON under bench/results/ (``--out``), with the machine and library versions.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # `python bench/http_load.py`: make the repo importable
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import machine_info as common_machine_info
from app.benchmark.machine import versions

RESULTS = ROOT / "bench" / "results"


# ----------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess we started (or an existing URL we only target)."""

    def __init__(self, name: str, url: str, proc: subprocess.Popen | None = None, log: Path | None = None):
        self.name, self.url, self.proc, self.log = name, url, proc, log

    def wait_ready(self, timeout: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log.read_text()[-2000:] if self.log else ""
                raise SystemExit(f"{self.name} server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} server not ready within {timeout:.0f} s")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_yolopipe(args: argparse.Namespace, logdir: Path) -> Server:
    port = free_port()
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLOPIPE_ENGINES_DIR": str(args.engines_dir),
           "YOLOPIPE_MAX_QUEUE": str(args.max_queue)}
    cmd = [sys.executable, "-m", "app.cli", "serve", "--weights", args.weights, "--backend", args.backend,
           "--precision", args.precision, "--host", "127.0.0.1", "--port", str(port),
           "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms), "--device", str(args.device)]
    log = logdir / "yolopipe_server.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return Server("yolopipe", f"http://127.0.0.1:{port}", proc, log)


def start_naive(args: argparse.Namespace, workers: int, logdir: Path) -> Server:
    from app.weights import resolve_weights

    port = free_port()
    device = "cpu" if args.backend == "onnxruntime" or not has_gpu() else str(args.device)
    cmd = [sys.executable, str(ROOT / "bench" / "naive_server.py"), "--weights", str(resolve_weights(args.weights)),
           "--port", str(port), "--workers", str(workers), "--device", device]
    log = logdir / f"naive_server_w{workers}.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "YOLO_OFFLINE": "1"}, cwd=ROOT)
    return Server(f"naive-ultralytics-{workers}w", f"http://127.0.0.1:{port}", proc, log)


# ----------------------------------------------------------------------------- clients
def load_images(folder: Path, limit: int) -> list[bytes]:
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))[:limit]
    if not files:
        raise SystemExit(f"no JPEG files in {folder}")
    return [p.read_bytes() for p in files]


async def _closed_loop(url: str, images: list[bytes], clients: int, start_at: float, stop_at: float,
                       budget: int, timeout: float) -> tuple[list[float], Counter]:
    import httpx

    latencies: list[float] = []
    statuses: Counter = Counter()
    sent = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def one_client(k: int) -> None:
            nonlocal sent
            i = k
            while time.time() < stop_at and sent < budget:
                sent += 1
                body = images[i % len(images)]
                i += clients
                t0 = time.perf_counter()
                try:
                    r = await client.post(url, content=body, headers={"content-type": "image/jpeg"})
                    outcome = str(r.status_code)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                if time.time() > stop_at:
                    break  # finished after the window: not part of the measurement
                statuses[outcome] += 1
                if outcome == "200":
                    latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(one_client(k) for k in range(clients)))
    return latencies, statuses


async def _open_loop(url: str, images: list[bytes], rate: float, max_inflight: int, start_at: float,
                     stop_at: float, timeout: float) -> tuple[list[float], Counter]:
    """Requests at a fixed rate regardless of answers; beyond max_inflight a send counts as 'client_saturated'."""
    import httpx

    latencies: list[float] = []
    statuses: Counter = Counter()
    inflight = 0
    limits = httpx.Limits(max_connections=max_inflight, max_keepalive_connections=max_inflight)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def one(body: bytes) -> None:
            nonlocal inflight
            inflight += 1
            t0 = time.perf_counter()
            try:
                r = await client.post(url, content=body, headers={"content-type": "image/jpeg"})
                statuses[str(r.status_code)] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
            finally:
                inflight -= 1

        tasks = set()
        n = 0
        t_start = time.time()
        while time.time() < stop_at:
            due = t_start + n / rate
            await asyncio.sleep(max(0.0, due - time.time()))
            if inflight >= max_inflight:
                statuses["client_saturated"] += 1
            else:
                task = asyncio.create_task(one(images[n % len(images)]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            n += 1
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
    return latencies, statuses


def client_process(job: dict) -> tuple[list[float], dict]:
    """Runs in a client process (spawned): one event loop, many clients."""
    images = [Path(p).read_bytes() for p in job["image_paths"]]
    if job["mode"] == "closed":
        lat, st = asyncio.run(_closed_loop(job["url"], images, job["clients"], job["start_at"], job["stop_at"],
                                           job["budget"], job["timeout"]))
    else:
        lat, st = asyncio.run(_open_loop(job["url"], images, job["rate"], job["clients"], job["start_at"],
                                         job["stop_at"], job["timeout"]))
    return lat, dict(st)


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(latencies: list[float], statuses: Counter, seconds: float) -> dict:
    lat = sorted(latencies)
    total = sum(statuses.values())
    ms = lambda v: None if v is None else round(v * 1e3, 2)
    return {
        "seconds": round(seconds, 2),
        "requests": total,
        "ok": statuses.get("200", 0),
        "req_per_s": round(statuses.get("200", 0) / seconds, 1),
        "attempted_per_s": round(total / seconds, 1),
        "p50_ms": ms(percentile(lat, 50)),
        "p95_ms": ms(percentile(lat, 95)),
        "p99_ms": ms(percentile(lat, 99)),
        "max_ms": ms(lat[-1] if lat else None),
        "by_status": dict(sorted(statuses.items())),
        "errors": {k: v for k, v in sorted(statuses.items()) if k != "200"},
    }


def run_load(url: str, image_paths: list[str], *, mode: str, clients: int, procs: int, duration: float,
             max_requests: int, rate: float = 0.0, timeout: float = 60.0, label: str = "",
             sampler=None) -> dict:
    """Spread the clients over ``procs`` processes, all starting at the same instant."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    procs = max(1, min(procs, clients))
    start_at = time.time() + 2.0  # time for the processes to spawn and connect
    stop_at = start_at + duration
    jobs = [{
        "url": url, "image_paths": image_paths, "mode": mode, "start_at": start_at, "stop_at": stop_at,
        "clients": clients // procs + (1 if i < clients % procs else 0),
        "budget": max_requests // procs + (1 if i < max_requests % procs else 0),
        "rate": rate / procs, "timeout": timeout,
    } for i in range(procs)]
    spawn = multiprocessing.get_context("spawn")  # no fork of a parent with threads running
    with ProcessPoolExecutor(max_workers=procs, mp_context=spawn) as pool, Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeRemainingColumn(),
        transient=True,
    ) as progress:
        futures = [pool.submit(client_process, job) for job in jobs]
        task = progress.add_task(label, total=duration)
        while not all(f.done() for f in futures):
            now = time.time()
            progress.update(task, completed=min(duration, max(0.0, now - start_at)))
            if sampler is not None and now >= start_at:
                sampler.maybe_sample(now - start_at)
            time.sleep(0.2)
        latencies: list[float] = []
        statuses: Counter = Counter()
        for f in futures:
            lat, st = f.result()
            latencies.extend(lat)
            statuses.update(st)
    seconds = min(time.time(), stop_at) - start_at if max_requests else duration
    out = summarize(latencies, statuses, max(seconds, 1e-9))
    out.update(clients=clients, client_processes=procs, mode=mode)
    if mode == "open":
        out["target_rate"] = rate
    return out


# ----------------------------------------------------------------------------- soak sampling
class MemorySampler:
    """RSS of the server process tree (psutil) and its GPU memory (nvidia-smi) every ``every_s``."""

    def __init__(self, pid: int | None, metrics_url: str, every_s: float):
        self.pid, self.metrics_url, self.every_s = pid, metrics_url, every_s
        self.samples: list[dict] = []
        self._next = 0.0

    def maybe_sample(self, t: float) -> None:
        if t < self._next:
            return
        self._next = t + self.every_s
        self.samples.append({"t_s": round(t, 1), "rss_bytes": self._rss(), "gpu_bytes": self._gpu()})

    def _rss(self) -> int | None:
        if self.pid is None:
            return None
        import psutil

        try:
            proc = psutil.Process(self.pid)
            return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.Error:
            return None

    def _gpu(self) -> int | None:
        if self.pid is not None and shutil.which("nvidia-smi"):
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, check=False).stdout
            used = [int(line.split(",")[1]) for line in out.splitlines()
                    if line.strip() and line.split(",")[0].strip() == str(self.pid)]
            if used:
                return used[0] * 1024 * 1024
        try:  # the server's own gauge (device-wide, from NVML)
            import httpx

            text = httpx.get(self.metrics_url, timeout=2).text
            vals = [float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith('yolopipe_gpu_memory_bytes{source="device"}')]
            return int(vals[0]) if vals else None
        except Exception:  # noqa: BLE001 (a missed sample is recorded as None, the soak goes on)
            return None

    def report(self, warmup_fraction: float = 0.1) -> dict:
        """Growth after warm-up: (max - first) / first over the samples past the first 10 %."""
        out: dict = {"samples": self.samples}
        if not self.samples:
            return out
        horizon = self.samples[-1]["t_s"]
        steady = [s for s in self.samples if s["t_s"] >= warmup_fraction * horizon]
        for key in ("rss_bytes", "gpu_bytes"):
            vals = [s[key] for s in steady if s[key]]
            if len(vals) >= 2:
                growth = (max(vals) - vals[0]) / vals[0]
                spread = (max(vals) - min(vals)) / min(vals)
                out[key.replace("_bytes", "")] = {
                    "first": vals[0], "min": min(vals), "max": max(vals), "last": vals[-1],
                    "growth_pct": round(100 * growth, 2), "spread_pct": round(100 * spread, 2),
                    "flat_within_5pct": spread <= 0.05,
                }
        return out


# ----------------------------------------------------------------------------- the machine
def has_gpu() -> bool:
    try:
        from app.gpu.probe import cuda_device_count

        return cuda_device_count() > 0
    except Exception:  # noqa: BLE001 (no GPU probe means no GPU for the baseline)
        return False


def machine_info() -> dict:
    return {**common_machine_info(), "versions": versions()}


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, default=None, help="folder of JPEGs (default: Ultralytics' assets)")
    p.add_argument("--max-images", type=int, default=20)
    p.add_argument("--target", default=None, help="URL of a running yolopipe server (else one is started)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--procs", type=int, default=1, help="client processes")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per measured server")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="request budget per measured server")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of unmeasured load first")
    p.add_argument("--timeout", type=float, default=60.0, help="client timeout per request")
    # the yolopipe server we start
    p.add_argument("--weights", default="sample")
    p.add_argument("--backend", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--max-queue", type=int, default=512)
    p.add_argument("--engines-dir", type=Path, default=ROOT / "engines")
    # the baseline
    p.add_argument("--no-naive", action="store_true", help="skip the naive Ultralytics baseline")
    p.add_argument("--naive-workers", default="1", help="uvicorn worker counts for the baseline, e.g. 1,4")
    p.add_argument("--naive-duration", type=float, default=None, help="seconds for the baseline (default: --duration)")
    # soak
    p.add_argument("--soak", type=float, default=0.0, help="minutes of open-loop load at --rate")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s for --soak")
    p.add_argument("--sample-s", type=float, default=10.0, help="memory sampling interval in --soak")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: bench/results/http_load-...json)")
    return p.parse_args(argv)


def measure(server: Server, args: argparse.Namespace, image_paths: list[str], duration: float) -> dict:
    url = f"{server.url}/v1/detect"
    if args.warmup > 0:
        run_load(url, image_paths, mode="closed", clients=args.clients, procs=args.procs, duration=args.warmup,
                 max_requests=args.max_requests, timeout=args.timeout, label=f"{server.name} warm-up")
    return run_load(url, image_paths, mode="closed", clients=args.clients, procs=args.procs, duration=duration,
                    max_requests=args.max_requests, timeout=args.timeout, label=server.name)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("YOLO_OFFLINE", "1")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    folder = args.images
    if folder is None:
        import importlib.util

        spec = importlib.util.find_spec("ultralytics")
        folder = Path(spec.origin).parent / "assets"
    image_paths = [str(p) for p in sorted(q for q in folder.rglob("*") if q.suffix.lower() in (".jpg", ".jpeg"))
                   ][: args.max_images]
    if not image_paths:
        raise SystemExit(f"no JPEG files in {folder}")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"yolopipe-http-load-{stamp}"
    logdir.mkdir(parents=True, exist_ok=True)

    result: dict = {
        "benchmark": "http_load" if not args.soak else "http_soak",
        "when": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "images": {"folder": str(folder), "count": len(image_paths)},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "servers": {},
    }
    started: list[Server] = []
    try:
        server = Server("yolopipe", args.target) if args.target else start_yolopipe(args, logdir)
        if server.proc is not None:
            started.append(server)
        server.wait_ready()
        import httpx

        result["yolopipe_model"] = httpx.get(f"{server.url}/v1/model", timeout=10).json()
        result["yolopipe_model"].pop("class_names", None)
        result["yolopipe_model"].get("meta", {}).pop("names", None)

        if args.soak:
            sampler = MemorySampler(server.proc.pid if server.proc else None, f"{server.url}/metrics", args.sample_s)
            run = run_load(f"{server.url}/v1/detect", image_paths, mode="open", clients=args.clients,
                           procs=args.procs, duration=args.soak * 60, max_requests=0, rate=args.rate,
                           timeout=args.timeout, label="soak", sampler=sampler)
            run["memory"] = sampler.report()
            # 'client_saturated' is the load generator's own limit (--clients in flight), not a server
            # answer: raise --clients above the server's queue so that overload reaches the server.
            bad = {k: v for k, v in run["by_status"].items() if k not in ("200", "503", "client_saturated")}
            run["only_200_and_503"] = not bad
            if run["by_status"].get("client_saturated"):
                print("note: the client hit its in-flight limit; use --clients above the server's --max-queue")
            result["servers"]["yolopipe"] = run
        else:
            result["servers"]["yolopipe"] = measure(server, args, image_paths, args.duration)
        if server.proc is not None:
            result["servers"]["yolopipe"]["shutdown_exit_code"] = server.stop()

        if not args.no_naive and not args.soak:
            for workers in [int(w) for w in str(args.naive_workers).split(",") if w.strip()]:
                naive = start_naive(args, workers, logdir)
                started.append(naive)
                naive.wait_ready()
                result["servers"][naive.name] = measure(naive, args, image_paths, args.naive_duration or args.duration)
                naive.stop()
            ours = result["servers"]["yolopipe"]["req_per_s"]
            result["speedup_vs_naive"] = {
                name: round(ours / r["req_per_s"], 2) if r["req_per_s"] else None
                for name, r in result["servers"].items() if name != "yolopipe"
            }
    finally:
        for s in started:
            s.stop()

    out = args.out or RESULTS / f"http_{'soak' if args.soak else 'load'}-{stamp}-{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, r in result["servers"].items():
        print(f"{name:>24}: {r['req_per_s']:>8.1f} req/s  p50 {r['p50_ms']} ms  p95 {r['p95_ms']} ms  "
              f"p99 {r['p99_ms']} ms  errors {r['errors']}")
    if "speedup_vs_naive" in result:
        print(f"speed-up vs naive: {result['speedup_vs_naive']}")
    if args.soak:
        mem = result["servers"]["yolopipe"]["memory"]
        print(f"memory: rss {mem.get('rss')}  gpu {mem.get('gpu')}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
