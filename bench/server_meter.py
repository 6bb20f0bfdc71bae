"""What a server under load costs: CPU time and memory of its whole process tree, GPU memory."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path


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


class _CpuWindow:
    result: dict


class ServerMeter:
    def __init__(self, pid: int) -> None:
        self.pid = pid

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
        used = sum(v - before.get(pid, 0.0) for pid, v in after.items())
        cores = used / wall
        window.result = {"server_cpu_cores": round(cores, 2),
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
