"""``yolopipe serve``: the supervisor of N HTTP workers, M gRPC workers and one inference worker per GPU.

    supervisor ── inference workers (InferencePool): one per GPU, or ``cpu_workers`` on a CPU
             ├─── HTTP workers: uvicorn, each with its own SO_REUSEPORT listener on host:port
             └─── gRPC workers: grpc.aio, each with its own SO_REUSEPORT listener on host:grpc_port

It owns the run folder (sockets, status blocks, metrics files) and removes it at exit; one left by
a killed supervisor is removed when the next one starts (``app.ipc.layout``: its lock). A dead
worker of any kind is started again; SIGTERM or SIGINT drains everything in order — the HTTP
and gRPC workers finish their requests (the inference workers still serving them), then the
inference workers stop — and the supervisor exits 0.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from app.errors import InvalidParameter, YolopipeError
from app.ipc.layout import RunLayout
from app.runtime import inference_devices
from app.service.grpc_worker import grpc_worker_main
from app.service.http_worker import http_worker_main
from app.service.inference.worker import DetectorFactory
from app.service.pool import InferencePool
from app.service.processes import metrics_folder, setup_logging
from app.settings import Settings

log = logging.getLogger("yolopipe.serving")

_YOUNG_S = 5.0  # an HTTP worker that dies younger than this is restarted after a pause


def serve(settings: Settings, *, detector_factory: DetectorFactory | None = None) -> None:
    """``detector_factory``: what the inference workers open their detector with (default: the
    model of ``settings``); a benchmark's or test's hook to run the real service around another
    detector (``app.service.inference.worker.DetectorFactory``), not a CLI option."""
    serving = settings
    setup_logging()
    devices = inference_devices(serving)
    n_http = http_worker_count(serving.workers, len(devices), on_gpu=devices[0] is not None)
    n_grpc = (serving.grpc_workers or n_http) if serving.grpc_port else 0
    if serving.grpc_port == serving.port:
        raise InvalidParameter(f"--grpc-port {serving.grpc_port} is --port too; give gRPC a port of its own (or 0)")
    _check_port_free(serving.host, serving.port, "--port")
    if n_grpc:
        _check_grpc_port_free(serving)
    layout = RunLayout.create(len(devices))
    with metrics_folder(layout.metrics_dir):  # every child writes there
        _supervise(serving, layout, devices, n_http, n_grpc, detector_factory)
    log.info("stopped")


def _supervise(serving: Settings, layout: RunLayout, devices: list[str | None], n_http: int, n_grpc: int,
               detector_factory: DetectorFactory | None = None) -> None:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    pool = InferencePool(serving, layout, devices, detector_factory=detector_factory)
    fronts = [FrontWorkers(serving, layout, n_http, stop, http_worker_main, "HTTP")]
    if n_grpc:
        fronts.append(FrontWorkers(serving, layout, n_grpc, stop, grpc_worker_main, "gRPC"))
    try:
        log.info("starting %d inference worker(s) (%s), %d HTTP worker(s) on %s:%d and %d gRPC worker(s)%s; "
                 "run folder %s", len(devices), ", ".join(f"cuda:{d}" if d is not None else "cpu" for d in devices),
                 n_http, serving.host, serving.port, n_grpc, f" on port {serving.grpc_port}" if n_grpc else "",
                 layout.root)
        # The HTTP workers start while the inference workers warm up, so that /readyz answers
        # meanwhile: 503 naming each worker's start-up step (opening the model, each bucket).
        pool_started: dict[str, Any] = {}
        layout.starting.touch()  # not ready until every inference worker is
        starting = threading.Thread(target=_start_pool, args=(pool, stop, pool_started), name="yolopipe-pool-start")
        starting.start()
        try:
            start_all(fronts)
            if not pool_started.get("done"):
                log.info("HTTP workers listening; /readyz says ready once the inference workers are")
        except BaseException:
            stop.set()  # the inference workers stop warming up
            raise
        finally:
            starting.join()
        if "error" in pool_started:
            raise pool_started["error"]
        if not pool_started["started"]:
            return  # SIGTERM while the inference workers warmed up
        layout.starting.unlink()
        log.info("serving on http://%s:%d%s", serving.host, serving.port,
                 f" and gRPC on port {serving.grpc_port}" if n_grpc else "")
        while not stop.is_set():
            for front in fronts:
                front.replace_dead(timeout=0.5 / len(fronts))
        log.info("draining: HTTP and gRPC workers finish their requests, then the inference workers stop")
        stop_all(fronts, serving.request_timeout_s)
    finally:
        stop_all(fronts, 0.0)
        pool.stop(serving.request_timeout_s)
        layout.remove()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _start_pool(pool: InferencePool, stop: threading.Event, out: dict[str, Any]) -> None:
    """``pool.start`` on its own thread: ``out`` gets ``started`` or the ``error`` it raised."""
    try:
        out["started"] = pool.start(stop)
    except BaseException as exc:  # noqa: BLE001 (raised again by the supervisor's thread)
        out["error"] = exc
        stop.set()  # an HTTP worker still starting gives up at once
    finally:
        out["done"] = True


def http_worker_count(given: int, inference_workers: int, *, on_gpu: bool) -> int:
    """Given, or: every core but two per GPU worker (its host threads); on the CPU the model
    needs the cores and HTTP is cheap beside it, so one worker per eight cores."""
    if given:
        return given
    cores = os.cpu_count() or 1
    if on_gpu:
        return max(1, min(32, cores - 2 * inference_workers))
    return max(1, cores // 8)


def _check_port_free(host: str, port: int, option: str) -> None:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise InvalidParameter(f"cannot listen on {host}:{port}: {exc.strerror}",
                                   hint=f"choose another {option} or stop what uses it") from None


def _check_grpc_port_free(serving: Settings) -> None:
    """The gRPC port free, else one line: which port (and where its number came from) and the way out."""
    try:
        _check_port_free(serving.host, serving.grpc_port, "--grpc-port")
    except InvalidParameter as exc:
        given = "grpc_port" in serving.model_fields_set  # --grpc-port or YOLOPIPE_GRPC_PORT
        raise InvalidParameter(f"{exc.message} (the gRPC port{'' if given else ', --port + 1 by default'}); "
                               f"choose another with --grpc-port N, or --grpc-port 0 for no gRPC") from None


def start_all(fronts: list[FrontWorkers]) -> None:
    """Every HTTP and gRPC worker started at once, then each waited for until it listens."""
    launched = [(front, front.launch()) for front in fronts]
    for front, pipes in launched:
        for slot, receive in pipes:
            error = front.listening(slot, receive)
            if error is not None:
                stop_all(fronts, 0.0)
                raise YolopipeError(f"{front.kind} worker could not start: {error}")


def stop_all(fronts: list[FrontWorkers], drain_s: float) -> None:
    """Every front-end worker is told to stop at once, then each is waited for."""
    for front in fronts:
        front.terminate()
    deadline = time.monotonic() + drain_s + 10.0
    for front in fronts:
        front.join(deadline)


class FrontWorkers:
    """The HTTP (or gRPC) worker processes: ``target`` is their entry point, ``kind`` their name
    in the log. ``stop``: set by SIGTERM; no pause or wait here outlasts it by more than a
    fraction of a second."""

    def __init__(self, settings: Settings, layout: RunLayout, count: int, stop: threading.Event,
                 target: Any = http_worker_main, kind: str = "HTTP") -> None:
        self.settings = settings
        self.layout = layout
        self.count = count
        self.target = target
        self.kind = kind
        self._stop = stop
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = [None] * count
        self._started_at = [0.0] * count
        self._pauses = [0.0] * count

    def start(self) -> None:
        start_all([self])

    def launch(self) -> list[tuple[int, Any]]:
        """Every worker started at once (each imports for a second or so): (slot, its pipe)."""
        return [(slot, self._launch(slot)) for slot in range(self.count)]

    def _launch(self, slot: int) -> Any:
        receive, send = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=self.target, args=(self.settings, self.layout, os.getpid(), send),
                                 name=f"yolopipe-{self.kind.lower()}-{slot}")
        proc.start()
        send.close()
        self._procs[slot] = proc
        self._started_at[slot] = time.monotonic()
        return receive

    def _spawn(self, slot: int) -> str | None:
        return self.listening(slot, self._launch(slot))

    def listening(self, slot: int, receive: Any) -> str | None:
        """None once the worker in ``slot`` listens (or the service is stopping), else why not."""
        proc = self._procs[slot]
        try:
            deadline = time.monotonic() + 60.0
            while not wait([receive, proc.sentinel], 0.1):
                if self._stop.is_set():
                    return None  # stopping: it is terminated with the others
                if time.monotonic() > deadline:
                    return "no answer within 60 s"
            message = receive.recv()
        except EOFError:
            message = f"exited with code {proc.exitcode}"
        finally:
            receive.close()
        return None if message == "listening" else str(message)

    def replace_dead(self, timeout: float) -> None:
        sentinels = [p.sentinel for p in self._procs if p is not None]
        wait(sentinels, timeout)
        for slot, proc in enumerate(self._procs):
            if proc is None or proc.is_alive():
                continue
            proc.join()
            from app.ipc.metrics import mark_dead

            mark_dead(proc.pid, self.layout.metrics_dir)
            lived = time.monotonic() - self._started_at[slot]
            self._pauses[slot] = min(10.0, max(0.5, 2 * self._pauses[slot])) if lived < _YOUNG_S else 0.0
            log.error("%s worker pid %d ended with exit code %s after %.0f s; starting another%s", self.kind,
                      proc.pid, proc.exitcode, lived, f" in {self._pauses[slot]:.1f} s" if self._pauses[slot] else "")
            if self._stop.wait(self._pauses[slot]):
                return
            error = self._spawn(slot)
            if error is not None:
                log.error("%s worker could not start: %s", self.kind, error)

    def stop(self, drain_s: float) -> None:
        """SIGTERM: each stops accepting and finishes its requests (a graceful shutdown)."""
        self.terminate()
        self.join(time.monotonic() + drain_s + 10.0)

    def terminate(self) -> None:
        for p in self._procs:
            if p is not None and p.is_alive():
                p.terminate()

    def join(self, deadline: float) -> None:
        """Each worker by ``deadline`` (time.monotonic), else killed."""
        for p in self._procs:
            if p is None or p.exitcode is not None:
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.error("%s worker pid %d did not stop in time; killing it", self.kind, p.pid)
                p.kill()
                p.join()
