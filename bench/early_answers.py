"""Answers sent before the request's body was read (RFC 9112 §9.6), as clients see them: a server
with a 2 MiB body limit (the CPU model, ``uvicorn_options``, as tests/e2e/test_hostile_http.py
runs it) and N clients that each write a 3 MiB JPEG body whole, then read. Each should read a
413. Every code tree given (``--code DIR``: a checkout, e.g. ``git worktree add /tmp/base HEAD~1``)
runs on the web stack installed and, with ``--overlay DIR``, on that stack laid over it through
PYTHONPATH (``.ci/oldest.txt`` installed with ``pip install --target DIR --no-deps``).

    python bench/early_answers.py --code /tmp/base --code . --overlay /tmp/oldest \\
        --out bench/results/DATE-MACHINE-early-answers.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import result_header

BODY_LIMIT = 2 << 20
SERVER = f"""
import sys, uvicorn
from app.service.http_worker import create_service_app
from app.api.protocol import uvicorn_options
from app.config import Settings
settings = Settings(backend="onnxruntime", artifacts_dir=sys.argv[1], max_body_bytes={BODY_LIMIT})
uvicorn.run(create_service_app(settings), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning",
            **uvicorn_options(settings))
"""
STACK = "import fastapi, starlette, uvicorn, python_multipart; print(fastapi.__version__, starlette.__version__, " \
        "uvicorn.__version__, python_multipart.__version__)"


async def one(port: int, request: bytes) -> str:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)  # the whole request, then read: as most clients do
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        await reader.readexactly(int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1)))
        writer.close()
        return head[9:12].decode()
    except Exception as exc:  # noqa: BLE001 (what the client saw is the measurement)
        return type(exc).__name__


async def burst(port: int, clients: int) -> dict[str, int]:
    body = b"\xff\xd8\xff" + b"\0" * (BODY_LIMIT + (1 << 20))
    request = (b"POST /v1/detect HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n"
               % len(body)) + body
    seen: dict[str, int] = {}
    for outcome in await asyncio.gather(*(one(port, request) for _ in range(clients))):
        seen[outcome] = seen.get(outcome, 0) + 1
    return seen


def serve(code: Path, overlay: Path | None, artifacts: Path, port: int) -> subprocess.Popen:
    path = os.pathsep.join(str(p) for p in (overlay, code) if p is not None)
    return subprocess.Popen([sys.executable, "-c", SERVER, str(artifacts), str(port)], cwd=code,
                            env={**os.environ, "PYTHONPATH": path, "YOLO_OFFLINE": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", type=Path, action="append", required=True, help="a code tree (repeatable)")
    p.add_argument("--overlay", type=Path, help="a web stack laid over the installed one, run as well")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import httpx

    from app.builder.export import export_onnx
    from tests.net import free_port

    artifacts = Path(tempfile.mkdtemp(prefix="early-answers-"))
    export_onnx("sample", artifacts_dir=artifacts)
    rows = []
    for overlay in (None, args.overlay) if args.overlay else (None,):
        for code in args.code:
            code = code.resolve()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(x) for x in (overlay, code) if x is not None)}
            stack = subprocess.run([sys.executable, "-c", STACK], env=env, capture_output=True, text=True,
                                   check=True).stdout.split()
            commit = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=False).stdout.strip()
            port = free_port()
            proc = serve(code, overlay, artifacts, port)
            try:
                for _ in range(600):
                    try:
                        if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        time.sleep(0.2)
                for round_ in range(1, args.rounds + 1):
                    row = {"commit": commit, "fastapi": stack[0], "starlette": stack[1], "uvicorn": stack[2],
                           "python_multipart": stack[3], "round": round_, "clients": args.clients,
                           "outcomes": asyncio.run(burst(port, args.clients))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                proc.kill()
                proc.wait()
    out = {**result_header("bench/early_answers.py"), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
