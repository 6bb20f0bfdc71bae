"""The gRPC worker process: KServe v2 gRPC (``app.api.grpc``) in front of an ``InferenceClient``.

The same process model as an HTTP worker: it binds ``grpc_port`` with SO_REUSEPORT beside the
other gRPC workers, passes image bytes to the inference workers through its own shared-memory
rings, never decodes, and on SIGTERM/SIGINT stops accepting, lets its calls finish (up to the
request timeout) and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from app.ipc.layout import RunLayout
from app.service.memory import IdleRelease, release_memory
from app.service.processes import die_with_parent, run_event_loop, setup_logging, write_metrics_to
from app.settings import Settings

log = logging.getLogger("yolopipe.grpc")


def grpc_worker_main(settings: Settings, layout: RunLayout, parent_pid: int, report: Any) -> None:
    """Process entry (spawn): bind, say so, serve until SIGTERM/SIGINT, exit 0."""
    die_with_parent(parent_pid)
    write_metrics_to(layout.metrics_dir)  # before prometheus_client is imported
    setup_logging()
    run_event_loop(_serve(settings, layout, report))  # grpc.aio and the inference client on uvloop


async def _serve(settings: Settings, layout: RunLayout, report: Any) -> None:
    from app.api.grpc.server import address, create_server
    from app.ipc.client import InferenceClient

    inference = InferenceClient(settings, layout)
    server, service = create_server(settings, inference)
    where = address(settings.host, settings.grpc_port)
    try:
        server.add_insecure_port(where)
    except RuntimeError as exc:
        report.send(f"cannot listen on {where}: {exc}")
        raise SystemExit(3) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    report.send("listening")
    report.close()
    # Not long: the port already listens; until a worker is connected calls are UNAVAILABLE.
    await inference.start(wait_s=2.0)
    # After a burst of calls, what they held goes back once none has begun for a while.
    idle = IdleRelease(settings.idle_release_s, release_memory, busy=lambda: inference.calls_in_flight > 0,
                       activity=lambda: inference.calls)
    idle.start()
    await stop.wait()
    await idle.stop()
    service.draining = True  # ServerReady says false while the calls in flight finish
    await server.stop(grace=settings.request_timeout_s + 5)
    await inference.close()
    log.info("stopped")
