"""h2load (nghttp2's HTTP/2 load generator, C) as the gRPC load generator for ``ModelInfer``.

Closed loop: ``clients`` connections with one call in flight each (``-m 1``), the way wrk's rows
hold one request per connection. Every call sends the same prepared body: one photo as
``tritonclient.grpc`` sends it (a ``ModelInferRequest`` with the image as a BYTES element in
``raw_input_contents``), framed as a gRPC message. h2load sees HTTP/2 statuses only (a gRPC error
is a 200 with a ``grpc-status`` trailer), so each row also carries the server's own count of
the calls by gRPC status over the same run (``yolopipe_grpc_requests_total`` in /metrics), and
``req_per_s`` counts the OK calls only.

    bash bench/h2load.sh          # unpacks Debian's h2load into .h2load/ (or have h2load on PATH)
"""

from __future__ import annotations

import re
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from bench.server_meter import metric_samples
from bench.wrk_client import find_unpacked

PATH = "/inference.GRPCInferenceService/ModelInfer"


def find_h2load(given: str | None = None) -> tuple[str, dict]:
    """The h2load binary (Debian's, unpacked under .h2load/ by bench/h2load.sh, or on PATH)."""
    return find_unpacked("h2load", ".h2load", given,
                         "h2load not found: run bench/h2load.sh (unpacks Debian's nghttp2-client into .h2load/)")


def infer_request(image: bytes, model: str = "yolopipe") -> bytes:
    """A serialized ModelInferRequest of one image, as ``tritonclient.grpc`` sends it."""
    from app.api.grpc import messages

    request = messages.ModelInferRequest(model_name=model)
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(image)) + image)
    return request.SerializeToString()


def infer_body(image: bytes, model: str = "yolopipe") -> bytes:
    """One gRPC-framed ModelInferRequest: a flag byte (not compressed), the length, the message."""
    message = infer_request(image, model)
    return b"\0" + struct.pack(">I", len(message)) + message


def grpc_codes(metrics_url: str) -> dict[str, float]:
    """The server's count of ModelInfer calls by gRPC status code, from /metrics."""
    codes: dict[str, float] = {}
    for sample in metric_samples(metrics_url):
        if sample.name == "yolopipe_grpc_requests_total" and sample.labels.get("method") == "ModelInfer":
            code = sample.labels.get("code")
            if code:
                codes[code] = codes.get(code, 0.0) + sample.value
    return codes


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, -(-len(sorted_values) * q // 100) - 1))
    return round(sorted_values[int(k)], 2)


def run_h2load(host: str, port: int, image: bytes, *, clients: int, duration_s: float, metrics_url: str | None,
               threads: int | None = None, h2load: str | None = None) -> dict:
    """One closed-loop run; the OK calls' rate, every call's latency percentiles, and statuses.
    ``metrics_url``: yolopipe's /metrics, where the calls are counted by gRPC status; None (a
    server without them): every call answered with HTTP/2 200 counts as OK."""
    binary, env = find_h2load(h2load)
    threads = max(1, min(threads or 8, clients))
    with tempfile.TemporaryDirectory(prefix="yolopipe-h2load-") as tmp:
        body, log = Path(tmp) / "body.bin", Path(tmp) / "calls.tsv"
        body.write_bytes(infer_body(image))
        before = grpc_codes(metrics_url) if metrics_url else {}
        started = time.monotonic()
        cmd = [binary, f"-c{clients}", "-m1", f"-t{threads}", f"-D{max(1, round(duration_s))}",
               "-d", str(body), "-H", "content-type: application/grpc",
               "-H", "te: trailers", f"--log-file={log}", f"http://{host}:{port}{PATH}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        wall = time.monotonic() - started
        if proc.returncode != 0:
            raise RuntimeError(f"h2load failed ({proc.returncode}): {proc.stderr[-2000:]}\n{proc.stdout[-2000:]}")
        after = grpc_codes(metrics_url) if metrics_url else {}
        calls = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
    codes = {k: int(after.get(k, 0) - before.get(k, 0)) for k in sorted(set(after) | set(before))}
    codes = {k: v for k, v in codes.items() if v}
    http = {}
    for _, status, _ in calls:
        http[status] = http.get(status, 0) + 1
    ok = codes.get("OK", 0) if metrics_url else http.get("200", 0)
    seconds = _finished_in(proc.stdout) or wall
    latency = sorted(int(c[2]) / 1000 for c in calls)
    errored = re.search(r"(\d+) failed, (\d+) errored, (\d+) timeout", proc.stdout)
    return {
        "clients": clients, "h2load_threads": threads, "duration_s": round(seconds, 2),
        "req_per_s": round(ok / seconds, 1), "answered_per_s": round(len(calls) / seconds, 1),
        "answers_ok": ok, "ok_counted_by": "the server's /metrics" if metrics_url else "h2load's HTTP/2 200s",
        "grpc_codes": codes, "http_statuses": http,
        "h2load_failed_errored_timeout": [int(g) for g in errored.groups()] if errored else None,
        "p50_ms": percentile(latency, 50), "p99_ms": percentile(latency, 99), "p999_ms": percentile(latency, 99.9),
        "max_ms": round(latency[-1], 2) if latency else None, "latency_of": "every call (h2load cannot tell OK apart)",
        "only_ok_and_unavailable": set(codes) <= {"OK", "UNAVAILABLE"} and set(http) <= {"200"},
        "body_bytes": len(infer_body(image)), "mode": "closed",
    }


def _finished_in(stdout: str) -> float | None:
    """h2load's own measured time ("finished in 30.00s, ...")."""
    found = re.search(r"finished in ([\d.]+)(ms|s)", stdout)
    if not found:
        return None
    return float(found.group(1)) / (1000 if found.group(2) == "ms" else 1)
