"""wrk as the HTTP load generator: run it with ``bench/wrk/multipart.lua``, read what it counted.

Closed loop (the load rows): one connection per wrk thread, so the script can time every
request and report the latency of the 200s alone. Open loop (the soak): ``rate`` requests/s
spread over the threads, each on a fixed schedule, many connections per thread.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "wrk" / "multipart.lua"
OIP_SCRIPT = ROOT / "bench" / "wrk" / "oip.lua"  # the same images as binary tensors to /v2/.../infer
RAW_SCRIPT = ROOT / "bench" / "wrk" / "raw.lua"  # the same images as raw image/jpeg bodies


def find_unpacked(name: str, folder: str, given: str | None, missing: str) -> tuple[str, dict]:
    """A load generator's binary and the environment it needs: ``given``, else Debian's unpacked
    under ``ROOT/folder`` (its libraries beside it), else ``name`` on PATH; else exit with ``missing``."""
    env = dict(os.environ)
    if given:
        return given, env
    local = ROOT / folder / "usr" / "bin" / name
    if local.exists():
        lib = str(ROOT / folder / "usr" / "lib" / "x86_64-linux-gnu")
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        return str(local), env
    on_path = shutil.which(name)
    if on_path:
        return on_path, env
    raise SystemExit(missing)


def find_wrk(given: str | None = None) -> tuple[str, dict]:
    """The wrk binary (Debian's, unpacked under .wrk/ by ../shared/device/wrk.sh, or on PATH)."""
    return find_unpacked("wrk", ".wrk", given,
                         "wrk not found: run ../shared/device/wrk.sh (unpacks Debian's wrk into .wrk/) or install wrk")


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return round(sorted_values[k], 2)


def run_wrk(url: str, image_list: Path, *, connections: int, duration_s: float, threads: int | None = None,
            rate: float = 0.0, timeout_s: float = 60.0, wrk: str | None = None, script: Path = SCRIPT) -> dict:
    """One wrk run; returns the counts, rates and the 200s' latency percentiles. The scripts post
    to ``url``'s path (``WRK_PATH``)."""
    from urllib.parse import urlsplit

    binary, env = find_wrk(wrk)
    threads = threads or connections  # closed loop: one connection per thread
    with tempfile.TemporaryDirectory(prefix="yolopipe-wrk-") as tmp:
        out = Path(tmp) / "wrk.json"
        parts = urlsplit(url)
        env.update(WRK_IMAGES=str(image_list), WRK_OUT=str(out), WRK_RATE=str(rate / threads if rate else 0),
                   WRK_PATH=(parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
        cmd = [binary, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration_s))}s",
               f"--timeout={round(timeout_s)}s", "-s", str(script), url]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr[-2000:]}\n{proc.stdout[-2000:]}")
        raw = json.loads(out.read_text())
    seconds = raw["duration_s"]
    statuses = {k: raw["statuses"][k] for k in sorted(raw["statuses"])}
    answered = sum(statuses.values())
    lat = sorted(raw["lat200_ms"])
    row = {
        "clients": connections,
        "wrk_threads": threads,
        "duration_s": round(seconds, 2),
        "req_per_s": round(statuses.get("200", 0) / seconds, 1),
        "answered_per_s": round(answered / seconds, 1),
        "statuses": statuses,
        "answers_ok": statuses.get("200", 0),
        "socket_errors": raw["socket_errors"],
        "wrk_latency_ms_all_statuses": raw["wrk_latency_ms"],
        "mode": "open" if rate else "closed",
    }
    if rate:
        row["target_rate"] = rate
    else:  # the 200s' own latency (one connection per thread makes each request traceable)
        row.update(p50_ms=percentile(lat, 50), p99_ms=percentile(lat, 99), p999_ms=percentile(lat, 99.9),
                   max_ms=round(lat[-1], 2) if lat else None)
    row["only_200_and_503"] = set(statuses) <= {"200", "503"} and not any(raw["socket_errors"].values())
    return row
