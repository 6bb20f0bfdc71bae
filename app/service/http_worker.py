"""The HTTP worker process: the api app in front of an ``InferenceClient``; and the same app
with inference workers of its own (tests, embedding).

``yolopipe serve``'s HTTP workers connect to the inference workers the supervisor runs (its
run folder, ``layout``); ``create_service_app`` starts its own for the app's lifetime, through
the same pool.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from app.api.main import create_app
from app.ipc.client import InferenceClient
from app.ipc.layout import RunLayout
from app.service.memory import ActivityMiddleware, IdleRelease, release_memory
from app.service.processes import die_with_parent, setup_logging, write_metrics_to
from app.settings import Settings

if TYPE_CHECKING:  # an HTTP worker of `serve` does not import the inference worker's code
    from app.service.inference.worker import DetectorFactory


class OwnWorkers(InferenceClient):
    """An ``InferenceClient`` that starts its own inference workers and stops them on close."""

    def __init__(self, settings: Settings, detector_factory: DetectorFactory | None = None) -> None:
        super().__init__(settings, None)
        self._pool = None
        self._detector_factory = detector_factory

    async def start(self, wait_s: float = 30.0) -> None:
        from app.runtime import inference_devices  # here: an HTTP worker of `serve` must not load the model's code
        from app.service.pool import InferencePool

        devices = inference_devices(self.settings)
        self.layout = RunLayout.create(len(devices))
        self._pool = InferencePool(self.settings, self.layout, devices, detector_factory=self._detector_factory)
        try:
            await asyncio.to_thread(self._pool.start)
        except BaseException:
            self.layout.remove()
            raise
        await super().start(wait_s)

    async def close(self) -> None:
        await super().close()
        if self._pool is not None:
            await asyncio.to_thread(self._pool.stop, self.settings.request_timeout_s)
            self.layout.remove()


def create_service_app(settings: Settings | None = None, *, detector_factory: DetectorFactory | None = None
                       ) -> FastAPI:
    """The whole service in this process's app: its inference workers start with it (opening
    their detector with ``detector_factory``, a test's or benchmark's; default: the model's)."""
    settings = settings or Settings()
    return create_app(settings, OwnWorkers(settings, detector_factory))


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """This HTTP worker's own listener; the kernel spreads new connections over all of them."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def http_worker_main(settings: Settings, layout: RunLayout, parent_pid: int, report: Any) -> None:
    """Process entry (spawn): bind, say so, serve until SIGTERM/SIGINT, exit 0."""
    die_with_parent(parent_pid)
    write_metrics_to(layout.metrics_dir)
    setup_logging()
    import uvicorn

    from app.api.protocol import uvicorn_options

    try:
        sock = listen(settings.host, settings.port)
    except OSError as exc:
        report.send(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}")
        raise SystemExit(3) from None
    report.send("listening")
    report.close()
    options: dict[str, Any] = dict(
        lifespan="on",
        access_log=False,  # per-request lines cost throughput; /metrics counts requests by status
        log_level="warning",
        timeout_graceful_shutdown=int(settings.request_timeout_s) + 5,  # in-flight requests end by then
        **uvicorn_options(settings),  # header and URL limits, read timeouts, JSON protocol errors
    )
    app = create_app(settings, InferenceClient(settings, layout))
    idle = IdleRelease(settings.idle_release_s, release_memory, busy=lambda: activity.in_flight > 0)
    activity = ActivityMiddleware(app, idle)  # after a burst, its bodies and answers' memory goes back
    server = uvicorn.Server(uvicorn.Config(activity, **options))
    # Uvicorn re-raises the signal it shut down for once it is done, which would end the process
    # with -15; a graceful shutdown is a clean exit, so let that signal land on a no-op.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    quiet_garbage_collector()
    server.run(sockets=[sock])


def quiet_garbage_collector() -> None:
    """Fewer collections while serving: what the process built so far (modules, the app) is set
    aside for good (``gc.freeze``), and the youngest generation is collected every 20,000
    allocations rather than 700. A request allocates a few hundred containers, nearly all freed
    by their reference counts; each collection walked the in-flight requests' objects again (a
    few percent of a worker's CPU). What the garbage collector exists for, reference cycles,
    the request path avoids (``tests/unit/api/test_limits.py``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, *gc.get_threshold()[1:])
