"""A server under load: started and stopped (``Server``), and what it costs: CPU time and memory
of its whole process tree, GPU memory."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def wait_for_line(line: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until ``log`` (the server's output) has ``line`` on a line of its own."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line in log.read_text().splitlines():
            return
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise SystemExit(f"server did not say {line!r} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def wait_for_standbys(url: str, timeout_s: float) -> None:
    """Until every yolopipe inference worker's warm standby has warmed up (on a GPU it compiles
    and captures beside the serving worker; measured meanwhile, the rows would count that)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(f"{url}/v1/model", timeout=10).json()["serving"]["inference_workers"]
        if all(w.get("standby_ready") for w in workers):
            return
        time.sleep(1.0)
    print(f"warning: not every standby was ready within {timeout_s:g} s; measuring anyway", flush=True)


def metric_samples(metrics_url: str) -> list:
    """Every sample of a server's /metrics page, read by prometheus_client's parser of its text format."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=30).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


class Server:
    """A server process started from ``cmd`` (``{port}`` and ``{grpc_port}`` filled with free
    ports), its output in ``log``, metered over its whole process tree (``meter``)."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path) -> None:
        self.name, self.log = name, log
        self.port = free_port()
        self.grpc_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [c.replace("{port}", str(self.port)).replace("{grpc_port}", str(self.grpc_port)) for c in cmd]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.meter = ServerMeter(self.proc.pid)
        self.gpus = 0  # GPUs it runs on (yolopipe: read from /v1/model once ready)

    def wait_ready(self, timeout: float = 900.0) -> None:
        wait_ready(self.url, self.proc, self.log, timeout)

    def stop(self) -> int | None:
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def cpu_us_per_request(row: dict) -> float | None:
    """The server tree's CPU (``server_cpu_s``) per OK answer of a load row (``answers_ok``), in µs."""
    ok = row.get("answers_ok")
    return round(row["server_cpu_s"] / ok * 1e6, 1) if ok and "server_cpu_s" in row else None


class _CpuWindow:
    result: dict
    by_pid: dict[int, float]  # CPU seconds of each process of the tree inside the window


class ServerMeter:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def tree_pids(self) -> list[int]:
        """The server's process and every process under it, now."""
        return [p.pid for p in self._tree()]

    def _tree(self) -> list:
        import psutil

        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def _cpu_seconds(self) -> dict[int, float]:
        import psutil

        out = {}
        for p in self._tree():
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    @contextmanager
    def cpu(self):
        """CPU the server's processes spent inside the block: cores busy on average, % of the host."""
        window = _CpuWindow()
        before, t0 = self._cpu_seconds(), time.monotonic()
        yield window
        after, wall = self._cpu_seconds(), time.monotonic() - t0
        # a process that ended inside the window is missed; one started inside counts from 0
        by_pid = {pid: v - before.get(pid, 0.0) for pid, v in after.items()}
        used = sum(by_pid.values())
        cores = used / wall
        window.by_pid = by_pid
        window.result = {"server_cpu_s": round(used, 3), "server_cpu_cores": round(cores, 2),
                         "server_cpu_pct_of_host": round(100 * cores / (os.cpu_count() or 1), 1),
                         "server_processes": len(after)}

    def memory(self) -> dict:
        """RSS and PSS summed over the tree (PSS shares each shared-memory page among its mappers)."""
        import psutil

        rss = pss = 0
        pids = []
        for p in self._tree():
            try:
                info = p.memory_full_info()
                rss += info.rss
                pss += getattr(info, "pss", info.rss)
                pids.append(p.pid)
            except psutil.Error:
                pass
        return {"rss_bytes": rss, "pss_bytes": pss, "gpu_bytes": _gpu_bytes(pids)}


def _gpu_bytes(pids: list[int]) -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False).stdout
    wanted = {str(p) for p in pids}
    used = [int(line.split(",")[1]) for line in out.splitlines()
            if line.strip() and line.split(",")[0].strip() in wanted]
    return sum(used) * 1024 * 1024 if used else None
