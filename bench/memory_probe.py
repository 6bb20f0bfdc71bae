"""Memory after bursts (issue #30): does ``yolopipe serve`` give back what a burst took?

It starts ``yolopipe serve`` (or watches one already running, ``--pid``/``--url``), warms it
with a few single requests, measures the process tree at rest, then runs each burst and
samples the tree until ``--settle-s`` seconds after the burst's last response:

* ``batch32``: one ``/v1/detect/batch`` of 32 copies of one photo;
* ``pipelined40``: 40 clients that each send pipelined requests on one connection, never read an
  answer, and vanish (the "last response" is when the inference workers' queues are empty);
* ``concurrent500``: 500 concurrent ``/v1/detect``, each on its own connection.

Per checkpoint (rest, peak, last response, settled) it records each process's role
(supervisor, http, grpc, inference, standby, resource-tracker) and its ``/proc/<pid>/smaps``
split by owner (heap, glibc thread arenas, other anonymous memory, the shared-memory rings,
file-backed pages), the GPU memory of each process (nvidia-smi) when there is one, and
whether the tree came back within ``--tolerance`` of rest. ``--malloc-info`` also asks glibc
in each process, through gdb, how much of its heap is free but held (attribution only:
it stops each process for a moment).

    python bench/memory_probe.py --out bench/results/x.json           # CPU, starts its own server
    python bench/memory_probe.py --backend auto --out x.json          # on a GPU server
    python bench/memory_probe.py --bursts batch32 --settle-s 10       # one burst
    python bench/memory_probe.py --config before=@/tmp/main --config after= --bursts batch32,concurrent500
    python bench/memory_probe.py --engine-sweep --batches 1,4,8,16    # ONNX Runtime alone, no server

``--config`` (issue #49) starts a server per configuration and runs the bursts against each in
turn, interleaved over ``--rounds``: each burst's peak over rest and images per second.
``--engine-sweep`` runs ONNX Runtime alone, a fresh process per batch size and memory options.

Exit status 0 when the tree was back within the tolerance of rest ``--settle-s`` seconds
after every burst, 1 otherwise. tests/e2e/test_memory_bursts.py runs the same probe in CI,
with ``--until-back`` and a long deadline: the test asserts that memory comes back; how soon
is this probe's figure, not a timed test's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

MB = 1 << 20
BURSTS = ("batch32", "pipelined40", "concurrent500")
_THREAD_HEAP = 64 * MB  # glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's heaps are aligned to it


# ----------------------------------------------------------------------------- the process tree
def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def roles(root: int, port: int, inference_pids: set[int]) -> dict[int, str]:
    """pid → role: supervisor, http (listens on ``port``), grpc (listens elsewhere), inference,
    standby or resource-tracker."""
    import psutil

    out = {root: "supervisor"}
    for pid in _children(root):
        try:
            p = psutil.Process(pid)
            cmd = " ".join(p.cmdline())
            connections = getattr(p, "net_connections", None) or p.connections  # psutil < 6 names it so
            listens = {c.laddr.port for c in connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
        if "resource_tracker" in cmd:
            out[pid] = "resource-tracker"
        elif pid in inference_pids:
            out[pid] = "inference"
        elif port in listens:
            out[pid] = "http"
        elif listens:
            out[pid] = "grpc"
        else:
            out[pid] = "standby"
    return out


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size: each shared page (the rings, libraries) split among its mappers,
    so that a sum over the tree counts it once."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def smaps_owners(pid: int) -> dict[str, int]:
    """Resident bytes of one process by owner, from its mappings:

    heap: glibc's main arena (``[heap]``); thread_arenas: glibc's per-thread arenas (anonymous
    regions on a 64 MiB boundary); anon_other: other anonymous memory (large blocks glibc maps
    on their own, such as ONNX Runtime's arena chunks and big NumPy arrays; Python's object
    arenas; thread stacks); ring: the shared-memory image rings; shm_other: status blocks and
    metrics files; file: code, libraries and other files."""
    owners = dict.fromkeys(("heap", "thread_arenas", "anon_other", "ring", "shm_other", "file"), 0)
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return owners
    owner = "anon_other"
    for line in text.splitlines():
        if line and not line[0].isupper():  # a mapping's header: "start-end perms offset dev inode [path]"
            fields = line.split(None, 5)
            start = int(fields[0].split("-")[0], 16)
            path = fields[5] if len(fields) > 5 else ""
            if path == "[heap]":
                owner = "heap"
            elif "/ring-" in path:
                owner = "ring"
            elif path.startswith(("/dev/shm", "/dev/zero")) or "SYSV" in path:
                owner = "shm_other"
            elif path and not path.startswith("["):
                owner = "file"
            elif not path and start % _THREAD_HEAP == 0:
                owner = "thread_arenas"
            else:
                owner = "anon_other"
        elif line.startswith("Rss:"):
            owners[owner] += int(line.split()[1]) * 1024
    return owners


def malloc_info(pid: int, timeout: float = 30.0) -> dict | None:
    """glibc's own account (``malloc_info``, called in the process through gdb): arenas, bytes
    the arenas took from the system, bytes free inside them, bytes in blocks mapped alone."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return None
    with tempfile.NamedTemporaryFile(prefix="malloc-info-", suffix=".xml", delete=False) as f:
        path = f.name
    os.chmod(path, 0o666)
    cmds = [f'set $f = (void*)fopen("{path}", "w")', "call (int)malloc_info(0, $f)", "call (int)fclose($f)"]
    try:
        subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", *(arg for c in cmds for arg in ("-ex", c))],
                       capture_output=True, timeout=timeout, check=False)
        xml = Path(path).read_text()
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        Path(path).unlink(missing_ok=True)
    heaps = re.findall(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.DOTALL)
    if not heaps:
        return None

    def total(kind: str, body: str) -> int:
        m = re.search(rf'<system type="{kind}" size="(\d+)"/>', body)
        return int(m.group(1)) if m else 0

    def free(body: str) -> int:
        return sum(int(s) for s in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"/>', body))

    tail = xml.rsplit("</heap>", 1)[-1]
    mmap = re.search(r'<total type="mmap" count="(\d+)" size="(\d+)"/>', tail)
    return {
        "arenas": len(heaps),
        "main_arena_bytes": total("current", heaps[0][1]),
        "main_free_bytes": free(heaps[0][1]),
        "thread_arena_bytes": sum(total("current", b) for _, b in heaps[1:]),
        "thread_free_bytes": sum(free(b) for _, b in heaps[1:]),
        "mmapped_blocks": int(mmap.group(1)) if mmap else 0,
        "mmapped_bytes": int(mmap.group(2)) if mmap else 0,
    }


def gpu_bytes_by_pid() -> dict[int, int]:
    if not shutil.which("nvidia-smi"):
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False).stdout
    used: dict[int, int] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            used[int(parts[0])] = used.get(int(parts[0]), 0) + int(parts[1]) * MB
    return used


class Tree:
    """The server's processes, by role; snapshots of their memory."""

    def __init__(self, root: int, url: str, port: int) -> None:
        self.root, self.url, self.port = root, url, port
        self.roles: dict[int, str] = {}
        self.refresh()

    def refresh(self) -> None:
        import httpx

        workers = httpx.get(f"{self.url}/v1/model", timeout=10).json()["serving"]["inference_workers"]
        self.roles = roles(self.root, self.port, {w["pid"] for w in workers if w.get("pid")})

    def queued(self) -> int:
        import httpx

        workers = httpx.get(f"{self.url}/v1/model", timeout=10).json()["serving"]["inference_workers"]
        return sum(w["queued_images"] for w in workers)

    def pids(self) -> list[int]:
        return [self.root, *_children(self.root)]

    def rss(self) -> int:
        return sum(rss_bytes(pid) for pid in self.pids())

    def pss(self) -> int:
        return sum(pss_bytes(pid) for pid in self.pids())

    def snapshot(self, *, with_malloc: bool = False) -> dict:
        gpu = gpu_bytes_by_pid()
        procs = []
        for pid, role in sorted(self.roles.items(), key=lambda kv: kv[1]):
            row = {"pid": pid, "role": role, "rss_mb": round(rss_bytes(pid) / MB, 1),
                   "owners_mb": {k: round(v / MB, 1) for k, v in smaps_owners(pid).items()}}
            if pid in gpu:
                row["gpu_mb"] = round(gpu[pid] / MB, 1)
            if with_malloc and role != "resource-tracker":
                info = malloc_info(pid)
                if info is not None:
                    row["malloc"] = {k: (round(v / MB, 1) if k.endswith("_bytes") else v) for k, v in info.items()}
            procs.append(row)
        total = sum(p["rss_mb"] for p in procs)
        out = {"tree_rss_mb": round(total, 1), "processes": procs}
        if gpu:
            out["gpu_mb"] = round(sum(gpu.get(pid, 0) for pid in self.roles) / MB, 1)
        reported = self.gpu_metrics()
        if reported:
            out["gpu_metrics_mb"] = reported
        return out

    def gpu_metrics(self) -> dict[str, float]:
        """What the inference workers report (sampled every 5 s): torch's reserved pool
        ("allocator") and the device's used memory, per worker."""
        import httpx

        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        found = re.findall(r'^yolopipe_gpu_memory_bytes\{([^}]*)\} ([0-9.e+]+)$', text, re.MULTILINE)
        return {",".join(sorted(labels.replace('"', "").split(","))): round(float(v) / MB, 1) for labels, v in found}


class Sampler:
    """The tree's RSS (and with ``pss``, its PSS) every ``period`` seconds on a thread: the
    peaks, and the series. The list of processes is read again every half second, not at each
    sample, so that a fast sampler costs the machine little."""

    def __init__(self, tree: Tree, period: float = 0.25, *, pss: bool = False) -> None:
        self.tree, self.period, self.with_pss = tree, period, pss
        self.series: list[tuple[float, int]] = []
        self.pss_series: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = listed_at = time.monotonic()
        pids = self.tree.pids()
        while not self._stop.wait(self.period):
            now = time.monotonic()
            if now - listed_at > 0.5:
                pids, listed_at = self.tree.pids(), now
            self.series.append((now - t0, sum(rss_bytes(pid) for pid in pids)))
            if self.with_pss:
                self.pss_series.append(sum(pss_bytes(pid) for pid in pids))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max((v for _, v in self.series), default=0)

    @property
    def peak_pss(self) -> int:
        return max(self.pss_series, default=0)


# ----------------------------------------------------------------------------- the bursts
def http_request(path: str, body: bytes, content_type: str, host: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def multipart(field: str, files: list[bytes]) -> tuple[bytes, str]:
    boundary = "yolopipe-memory-probe"
    parts = [(f'--{boundary}\r\ncontent-disposition: form-data; name="{field}"; filename="{i}.jpg"\r\n'
              "content-type: image/jpeg\r\n\r\n").encode() + data + b"\r\n" for i, data in enumerate(files)]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


async def exchange(host: str, port: int, request: bytes, timeout: float) -> int | None:
    """Send one request, read its response to the end; its status (None: no answer)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
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


def _count(statuses: list[int | None]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in statuses:
        key = str(s) if s is not None else "no-answer"
        out[key] = out.get(key, 0) + 1
    return out


def burst_batch(host: str, port: int, photo: bytes, copies: int = 32, timeout: float = 900.0) -> dict:
    body, ctype = multipart("images", [photo] * copies)
    status = asyncio.run(exchange(host, port, http_request("/v1/detect/batch", body, ctype, host), timeout))
    return {"statuses": _count([status])}


def burst_concurrent(host: str, port: int, photo: bytes, clients: int = 500, timeout: float = 900.0) -> dict:
    request = http_request("/v1/detect", photo, "image/jpeg", host)

    async def run() -> list[int | None]:
        return await asyncio.gather(*(exchange(host, port, request, timeout) for _ in range(clients)))

    return {"statuses": _count(asyncio.run(run()))}


def burst_pipelined(host: str, port: int, photo: bytes, clients: int = 40, requests: int = 8,
                    linger_s: float = 3.0) -> dict:
    """Each client writes ``requests`` requests back to back, reads nothing, and after
    ``linger_s`` closes its socket with a reset (it vanishes)."""
    request = http_request("/v1/detect", photo, "image/jpeg", host)
    socks = []
    for _ in range(clients):
        s = socket.create_connection((host, port), timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the answers pile up on the server's side
        s.setblocking(False)
        socks.append([s, request * requests, 0])
    deadline = time.monotonic() + linger_s
    while time.monotonic() < deadline:
        progress = False
        for entry in socks:
            s, data, sent = entry
            if sent < len(data):
                try:
                    n = s.send(data[sent : sent + 65536])
                    entry[2] += n
                    progress = True
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    entry[2] = len(data)
        if not progress:
            time.sleep(0.02)
    written = sum(min(e[2], len(e[1])) for e in socks)
    for s, _, _ in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset on close
        s.close()
    return {"bytes_written": written, "requests_written": written // len(request)}


# ----------------------------------------------------------------------------- one run
def run_burst(tree: Tree, name: str, photo: bytes, rest_mb: float, args: argparse.Namespace,
              rest_gpu_mb: float | None = None, rest_pss_mb: float | None = None) -> dict:
    host, port = "127.0.0.1", tree.port
    before = tree.snapshot()
    t0 = time.monotonic()
    with Sampler(tree, args.sample_ms / 1e3, pss=rest_pss_mb is not None) as sampler:
        if name == "batch32":
            outcome = burst_batch(host, port, photo, copies=args.copies)
            outcome["images"] = args.copies if outcome["statuses"] == {"200": 1} else 0
        elif name == "concurrent500":
            outcome = burst_concurrent(host, port, photo, clients=args.clients)
            outcome["images"] = outcome["statuses"].get("200", 0)
        elif name == "pipelined40":
            outcome = burst_pipelined(host, port, photo)
        else:
            raise SystemExit(f"unknown burst {name!r}; choose from {', '.join(BURSTS)}")
        while tree.queued():  # vanished clients: the work they left is over when the queues are empty
            time.sleep(0.1)
        last = time.monotonic()
        at_last = tree.snapshot()  # quick: the settle clock runs
        series = []
        back_at = None
        settled_down = False
        while time.monotonic() - last < args.settle_s and not (settled_down and args.until_back):
            time.sleep(0.5)
            mb = tree.rss() / MB
            series.append((round(time.monotonic() - last, 2), round(mb, 1)))
            if back_at is None and mb <= rest_mb * (1 + args.tolerance):
                back_at = series[-1][0]
            # Back, and still for a second: each process gives back on its own quiet clock, so
            # the first sample within the tolerance can come between two of their releases.
            recent = [v for _, v in series[-3:]]
            settled_down = back_at is not None and len(recent) == 3 and max(recent) - min(recent) <= 0.01 * rest_mb
        watched = time.monotonic() - last
        settled = tree.snapshot(with_malloc=args.malloc_info)
    row = {
        "burst": name, **outcome,
        "seconds": round(last - t0, 2),
        "before_mb": before["tree_rss_mb"],
        "peak_mb": round(max(sampler.peak, 0) / MB, 1),
        "peak_over_rest_mb": round(sampler.peak / MB - rest_mb, 1),
        "at_last_response_mb": at_last["tree_rss_mb"],
        "settled_mb": settled["tree_rss_mb"],
        "settle_s": round(watched, 2),  # args.settle_s, or less with --until-back
        "back_within_tolerance_after_s": back_at,
        "returned": settled["tree_rss_mb"] <= rest_mb * (1 + args.tolerance),
        "series_mb": series,
        "at_last_response": at_last,
        "settled": settled,
    }
    if "images" in outcome:
        row["images_per_s"] = round(outcome["images"] / (last - t0), 3)
    if rest_pss_mb is not None:
        row["peak_pss_over_rest_mb"] = round(sampler.peak_pss / MB - rest_pss_mb, 1)
    if "gpu_mb" in settled and rest_gpu_mb is not None:  # device memory back to rest too
        row.update(gpu_rest_mb=rest_gpu_mb, gpu_at_last_response_mb=at_last["gpu_mb"], gpu_settled_mb=settled["gpu_mb"])
        row["returned"] = row["returned"] and settled["gpu_mb"] <= rest_gpu_mb * (1 + args.tolerance)
    if "gpu_settled_mb" in row:
        print(f"{'':>14}  GPU: {rest_gpu_mb:.0f} MB at rest, {row['gpu_at_last_response_mb']:.0f} at the last "
              f"response, {row['gpu_settled_mb']:.0f} after {watched:.1f} s", flush=True)
    print(f"{name:>14}: {row['before_mb']:.0f} MB before, peak {row['peak_mb']:.0f} "
          f"(+{row['peak_over_rest_mb']:.0f} over rest"
          + (f", PSS +{row['peak_pss_over_rest_mb']:.0f}" if "peak_pss_over_rest_mb" in row else "")
          + (f", {row['images_per_s']:.2f} img/s" if "images_per_s" in row else "") + "), "
          f"{row['at_last_response_mb']:.0f} at the last response, {row['settled_mb']:.0f} after {watched:.1f} s "
          f"(rest {rest_mb:.0f}; back within {100 * args.tolerance:g} % after {back_at} s)  {outcome}", flush=True)
    return row


def warm(url: str, photo: bytes, n: int) -> None:
    import httpx

    for _ in range(n):
        httpx.post(f"{url}/v1/detect", content=photo, headers={"content-type": "image/jpeg"}, timeout=60)


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, int]:
    from bench.server_meter import free_port, wait_ready

    port = free_port()
    code = Path(args.code or ROOT).resolve()
    # gRPC workers (where the server has them) on a free port, not the shared default
    env = {**os.environ, "YOLO_OFFLINE": "1", "PYTHONPATH": str(code), "YOLOPIPE_GRPC_PORT": str(free_port()),
           **dict(kv.split("=", 1) for kv in args.env)}
    cmd = [sys.executable, "-m", "app.cli", "serve", "--weights", args.weights, "--backend", args.backend,
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=code,
                            start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, args.ready_timeout_s)
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


def wait_standbys(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(f"{url}/v1/model", timeout=10).json()["serving"]["inference_workers"]
        if all(w.get("standby_ready") for w in workers):
            return
        time.sleep(0.5)


def probe(args: argparse.Namespace) -> dict:
    from app.benchmark.machine import machine_info, versions

    photo = Path(args.photo).read_bytes() if args.photo else _sample_photo()
    log = Path(tempfile.mkdtemp(prefix="yolopipe-memory-")) / "server.log"
    proc = None
    if args.pid:
        root, port = args.pid, int(args.url.rsplit(":", 1)[1])
    else:
        proc, port = start_server(args, log)
        root = proc.pid
    url = f"http://127.0.0.1:{port}"
    try:
        wait_standbys(url, args.ready_timeout_s)
        warm(url, photo, args.warmup)
        time.sleep(args.rest_s)
        tree = Tree(root, url, port)
        rest = tree.snapshot(with_malloc=args.malloc_info)
        rest["tree_pss_mb"] = round(tree.pss() / MB, 1)
        print(f"rest: {rest['tree_rss_mb']:.0f} MB (PSS {rest['tree_pss_mb']:.0f})  " + ", ".join(
            f"{p['role']} {p['rss_mb']:.0f}" for p in rest["processes"]), flush=True)
        rows = []
        for round_ in range(args.rounds):
            for name in args.bursts:
                tree.refresh()
                rows.append({"round": round_ + 1, **run_burst(tree, name, photo, rest["tree_rss_mb"], args,
                                                              rest.get("gpu_mb"), rest["tree_pss_mb"])})
        info = httpx_json(f"{url}/v1/model")
    finally:
        if proc is not None:
            stop_server(proc)
    return {
        "machine": machine_info(), "versions": versions(),
        "config": {"date": dt.datetime.now().isoformat(timespec="seconds"), "backend": args.backend,
                   "weights": args.weights, "env": args.env, "photo_bytes": len(photo), "warmup": args.warmup,
                   "settle_s": args.settle_s, "tolerance": args.tolerance, "rounds": args.rounds,
                   "copies": args.copies, "clients": args.clients, "sample_ms": args.sample_ms,
                   "server_code": str(Path(args.code or ROOT).resolve()), "model": info},
        "rest": rest, "bursts": rows,
        "returned": all(r["returned"] for r in rows),
    }


def _server_config(text: str) -> tuple[str, list[str], str | None]:
    """``NAME=TOKEN TOKEN ...``: each token ``VAR=VALUE`` (the server's environment) or ``@DIR``
    (the checkout whose server runs)."""
    name, _, spec = text.partition("=")
    env = [t for t in spec.split() if not t.startswith("@")]
    code = next((t[1:] for t in spec.split() if t.startswith("@")), None)
    if not name or any("=" not in t for t in env):
        raise SystemExit(f"--config {text!r}: NAME=VAR=VALUE ... or NAME=@DIR ...")
    return name, env, code


def sweep(args: argparse.Namespace) -> dict:
    """Servers of several configurations (``--config``), all started first, then the bursts run
    against each in turn, the order turned each round: per burst its peak over the resting RSS
    (and PSS) just before it, and the images answered per second."""
    import statistics

    from app.benchmark.machine import machine_info, versions

    photo = Path(args.photo).read_bytes() if args.photo else _sample_photo()
    configs = [_server_config(text) for text in args.config]
    logs = Path(tempfile.mkdtemp(prefix="yolopipe-memory-sweep-"))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    rows = []
    try:
        for name, env, code in configs:
            config_args = argparse.Namespace(**{**vars(args), "env": [*args.env, *env], "code": code or args.code})
            servers[name] = start_server(config_args, logs / f"{name}.log")
            url = f"http://127.0.0.1:{servers[name][1]}"
            wait_standbys(url, args.ready_timeout_s)
            warm(url, photo, args.warmup)
            print(f"{name}: ready on {url} ({' '.join(env + ([f'code {code}'] if code else []))})", flush=True)
        for round_ in range(args.rounds):
            turn = round_ % len(configs)
            for name, _, _ in configs[turn:] + configs[:turn]:
                proc, port = servers[name]
                tree = Tree(proc.pid, f"http://127.0.0.1:{port}", port)
                for burst in args.bursts:
                    time.sleep(args.rest_s)
                    tree.refresh()
                    rest_mb, rest_pss_mb = tree.rss() / MB, tree.pss() / MB
                    print(f"[{name}, round {round_ + 1}] rest {rest_mb:.0f} MB (PSS {rest_pss_mb:.0f})", flush=True)
                    row = run_burst(tree, burst, photo, rest_mb, args, None, rest_pss_mb)
                    rows.append({"config": name, "round": round_ + 1, "burst": burst, "rest_mb": round(rest_mb, 1),
                                 "rest_pss_mb": round(rest_pss_mb, 1),
                                 **{k: row.get(k) for k in ("statuses", "images_per_s", "peak_over_rest_mb",
                                                            "peak_pss_over_rest_mb", "seconds", "returned")}})
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    summary = []
    print(f"\n{'config':<16} {'burst':<14} {'peak RSS +MB':>12} {'peak PSS +MB':>12} {'img/s (median)':>15}")
    for name, env, code in configs:
        for burst in args.bursts:
            mine = [r for r in rows if r["config"] == name and r["burst"] == burst]
            line = {"config": name, "env": env, "code": code, "burst": burst,
                    "peak_over_rest_mb": max(r["peak_over_rest_mb"] for r in mine),
                    "peak_pss_over_rest_mb": max(r["peak_pss_over_rest_mb"] for r in mine),
                    "images_per_s": statistics.median(r["images_per_s"] or 0 for r in mine)}
            summary.append(line)
            print(f"{name:<16} {burst:<14} {line['peak_over_rest_mb']:>12.0f} {line['peak_pss_over_rest_mb']:>12.0f} "
                  f"{line['images_per_s']:>15.3f}")
    return {"machine": machine_info(), "versions": versions(),
            "config": {"date": dt.datetime.now().isoformat(timespec="seconds"), "backend": args.backend,
                       "env": args.env, "configs": args.config, "photo_bytes": len(photo), "rounds": args.rounds,
                       "copies": args.copies, "clients": args.clients, "sample_ms": args.sample_ms},
            "rows": rows, "summary": summary}


# ----------------------------------------------------------------------------- the engine alone
ORT_OPTIONS = {"arena+pattern": (True, True), "arena": (True, False), "pattern": (False, True), "none": (False, False)}


def engine_child(model: str, batch: int, options: str, threads: int, runs: int, photo: str) -> dict:
    """One ONNX Runtime configuration in this (fresh) process: the server's backend class on a
    batch of ``batch`` letterboxed copies of ``photo``; the resident set's peak over its level
    before the first run (sampled every 5 ms: the arena and the activations), and the wall and
    CPU time (all threads) of ``runs`` timed runs after one untimed."""
    import cv2
    import numpy as np

    from app.backends.onnxruntime import OnnxRuntimeBackend
    from app.imaging.letterbox import letterbox, to_input

    arena, pattern = ORT_OPTIONS[options]
    backend = OnnxRuntimeBackend(Path(model), threads=threads or None, memory_arena=arena, memory_pattern=pattern)
    image = cv2.imdecode(np.frombuffer(Path(photo).read_bytes(), np.uint8), cv2.IMREAD_COLOR)
    x = to_input([letterbox(image, 640)[0]] * batch)
    me = os.getpid()
    rest = peak = rss_bytes(me)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, rss_bytes(me))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    backend.infer(x)
    wall, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        backend.infer(x)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    done.set()
    sampler.join()
    return {"batch": batch, "ort": options, "peak_over_rest_mb": round((peak - rest) / MB, 1),
            "images_per_s": round(batch * runs / sum(wall), 3), "best_images_per_s": round(batch / min(wall), 3),
            "cpu_ms_per_image": round(1e3 * sum(cpu) / (batch * runs), 1)}


def engine_sweep(args: argparse.Namespace) -> dict:
    """Every (batch, ONNX Runtime options) pair, each in a fresh process, the pairs interleaved
    over ``--rounds`` (the order turned each round), so that a machine's drift falls on all."""
    import statistics

    from app.benchmark.machine import machine_info, versions

    model = args.model or str(_sample_model())
    photo = args.photo or str(_sample_photo_path())
    pairs = [(b, o) for b in args.batches for o in args.ort]
    rows = []
    for round_ in range(args.rounds):
        turn = round_ % len(pairs)
        for batch, options in pairs[turn:] + pairs[:turn]:
            code = ("import json, sys; from bench.memory_probe import engine_child; a = sys.argv; "
                    "print(json.dumps(engine_child(a[1], int(a[2]), a[3], int(a[4]), int(a[5]), a[6])))")
            out = subprocess.run([sys.executable, "-c", code, model, str(batch), options, str(args.ort_threads),
                                  str(args.runs), photo], cwd=ROOT, capture_output=True, text=True, check=False,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            if out.returncode:
                raise SystemExit(f"batch {batch}, {options}: exit {out.returncode}\n{out.stderr[-3000:]}")
            row = {"round": round_ + 1, **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(f"round {row['round']}  batch {batch:>3}  {options:<14} peak +{row['peak_over_rest_mb']:>6.0f} MB  "
                  f"{row['images_per_s']:6.3f} img/s (best run {row['best_images_per_s']:.3f})  "
                  f"{row['cpu_ms_per_image']:7.1f} ms CPU/img", flush=True)
    summary = []
    # On a shared machine the best run is the least disturbed one: its rate is the cleaner figure.
    print(f"\n{'batch':>5}  {'ort':<14} {'peak MB':>8} {'img/s (median)':>15} {'img/s (best)':>13} {'ms CPU/img':>11}")
    for batch, options in pairs:
        mine = [r for r in rows if r["batch"] == batch and r["ort"] == options]
        line = {"batch": batch, "ort": options, "peak_over_rest_mb": max(r["peak_over_rest_mb"] for r in mine),
                "images_per_s": statistics.median(r["images_per_s"] for r in mine),
                "best_images_per_s": max(r["best_images_per_s"] for r in mine),
                "cpu_ms_per_image": statistics.median(r["cpu_ms_per_image"] for r in mine)}
        summary.append(line)
        print(f"{batch:>5}  {options:<14} {line['peak_over_rest_mb']:>8.0f} {line['images_per_s']:>15.3f} "
              f"{line['best_images_per_s']:>13.3f} {line['cpu_ms_per_image']:>11.1f}")
    return {"machine": machine_info(), "versions": versions(),
            "config": {"date": dt.datetime.now().isoformat(timespec="seconds"), "model": model, "photo": photo,
                       "rounds": args.rounds, "runs": args.runs, "ort_threads": args.ort_threads},
            "rows": rows, "summary": summary}


def _sample_model() -> Path:
    from app.builder.export import export_onnx

    return export_onnx("sample").onnx_path


def httpx_json(url: str) -> dict:
    import httpx

    return httpx.get(url, timeout=10).json()


def _sample_photo_path() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("ultralytics").origin).parent / "assets" / "bus.jpg"


def _sample_photo() -> bytes:
    return _sample_photo_path().read_bytes()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bursts", type=lambda s: s.split(","), default=list(BURSTS), help="comma-separated, in order")
    p.add_argument("--weights", default="sample")
    p.add_argument("--backend", default="onnxruntime", help="auto on a GPU server")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the server (repeatable)")
    p.add_argument("--code", help="the checkout whose server runs (default: this one), e.g. a baseline's")
    p.add_argument("--pid", type=int, help="watch this running server (its supervisor) instead of starting one")
    p.add_argument("--url", help="with --pid: the server's http://127.0.0.1:PORT")
    p.add_argument("--photo", help="the image the bursts send (default: Ultralytics' bus.jpg)")
    p.add_argument("--rounds", type=int, default=1, help="run the bursts this many times (a slow climb shows)")
    p.add_argument("--copies", type=int, default=32, help="images of the batch32 burst's one request")
    p.add_argument("--clients", type=int, default=500, help="requests of the concurrent500 burst")
    p.add_argument("--sample-ms", type=float, default=20.0, help="the tree's RSS and PSS sampled this often")
    p.add_argument("--warmup", type=int, default=5, help="single requests before rest is measured")
    p.add_argument("--rest-s", type=float, default=3.0, help="pause before rest is measured")
    p.add_argument("--settle-s", type=float, default=10.0, help="seconds watched after each burst's last response")
    p.add_argument("--tolerance", type=float, default=0.10, help="back within this fraction of rest")
    p.add_argument("--until-back", action="store_true",
                   help="stop watching a burst once the tree is back and still for a second "
                        "(--settle-s is then only the deadline)")
    p.add_argument("--malloc-info", action="store_true", help="glibc's account per process, through gdb")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--config", action="append", default=[], metavar="NAME=VAR=VALUE ...|@DIR",
                   help="a sweep: servers of these configurations (repeatable), bursts interleaved over --rounds")
    p.add_argument("--engine-sweep", action="store_true",
                   help="ONNX Runtime alone, no server: peak and img/s for each of --batches × --ort")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 4, 8, 16],
                   help="--engine-sweep: the batch sizes")
    p.add_argument("--ort", type=lambda s: s.split(","), default=["arena+pattern", "arena"],
                   help=f"--engine-sweep: ONNX Runtime's memory options ({', '.join(ORT_OPTIONS)})")
    p.add_argument("--runs", type=int, default=3, help="--engine-sweep: timed runs per configuration and round")
    p.add_argument("--ort-threads", type=int, default=0, help="--engine-sweep: intra-op threads (0: every core)")
    p.add_argument("--model", help="--engine-sweep: the ONNX model (default: the sample model's export)")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine_sweep:
        result = engine_sweep(args)
    elif args.config:
        result = sweep(args)
    else:
        result = probe(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if result.get("returned", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
