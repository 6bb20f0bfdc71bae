"""The inference workers of one service: started, watched, restarted, stopped.

One keeper thread per worker starts its process, waits for it to be ready, waits for it to
end and, unless the service is stopping, starts it again (after a pause that grows while it
keeps dying young). The first start is the exception: a worker that cannot open its model
(missing weights, no GPU) fails ``start()`` with its own error, for the CLI to print.

With ``Settings.standby`` (the default) each serving worker has a warm standby beside it: a
process that opened the same detector (on the GPU: compiled it and captured its graphs) and
waits. When the worker dies, the standby takes over its socket at once (HTTP workers
reconnect within a tenth of a second) and a new standby starts warming; a restart from
scratch (seconds on the CPU, most of a minute on a GPU) is only needed when no standby is ready.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from app.errors import YolopipeError
from app.ipc.layout import RunLayout
from app.ipc.wire import StatusBlock, error_from_code
from app.service.inference.worker import DetectorFactory, WorkerSpec, worker_main
from app.settings import Settings

log = logging.getLogger("yolopipe.serving")

_HEALTHY_S = 60.0  # a worker that lived this long restarts at once when it dies
_MAX_BACKOFF_S = 10.0


class _Stopping(Exception):
    """Raised in a keeper asked to start a worker while the pool stops."""


@dataclass
class _Started:
    info: dict | None = None
    error: YolopipeError | None = None


class InferencePool:
    def __init__(self, settings: Settings, layout: RunLayout, devices: list[str | None], *,
                 detector_factory: DetectorFactory | None = None) -> None:
        """``detector_factory``: what each worker opens its detector with (``WorkerSpec``); None:
        the model of ``settings`` (``app.runtime.open_model_dir`` after ``ensure_artifacts``)."""
        self.settings = settings
        self.layout = layout
        self.devices = devices
        self.detector_factory = detector_factory
        self._ctx = multiprocessing.get_context("spawn")
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._procs: dict[int, Any] = {}
        self._standbys: dict[int, Any] = {}
        self._first: list[_Started] = [_Started() for _ in devices]
        self._first_done = [threading.Event() for _ in devices]
        self._keepers: list[threading.Thread] = []
        self.info: dict | None = None  # worker 0's hello: the model and its limits
        for i in range(len(devices)):
            StatusBlock(layout.status(i), writable=True).close()  # readers (HTTP workers) can open it at once

    def start(self, stop: threading.Event | None = None) -> bool:
        """Start every worker and wait until each is ready; raises the first one's start-up error.
        Worker 0 goes first so that a first export of the model happens once. False (the pool
        stopped) as soon as ``stop`` is set: a SIGTERM does not wait for a warm-up to end."""
        stop = stop or threading.Event()
        try:
            self._start_keeper(0)
            self._wait_first(0, stop)
            for i in range(1, len(self.devices)):
                self._start_keeper(i)
            for i in range(1, len(self.devices)):
                self._wait_first(i, stop)
        except _Stopping:
            self.stop(0.0)
            return False
        except BaseException:
            self.stop(0.0)
            raise
        self.info = self._first[0].info
        return True

    def pids(self) -> dict[int, int]:
        with self._lock:
            return {i: p.pid for i, p in self._procs.items() if not wait([p.sentinel], 0)}

    def stop(self, drain_s: float) -> None:
        """SIGTERM every worker (each finishes its admitted work), SIGKILL what is left after
        ``drain_s`` + 5 s. Only keepers reap their processes (two reapers could race)."""
        self._stopping.set()
        with self._lock:
            procs = list(self._procs.values()) + list(self._standbys.values())
        for p in procs:
            if not wait([p.sentinel], 0):
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + drain_s + 5.0
        for t in self._keepers:
            t.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if not wait([p.sentinel], 0):
                log.error("inference worker pid %d did not stop in time; killing it", p.pid)
                os.kill(p.pid, signal.SIGKILL)
        for t in self._keepers:
            t.join()

    # --- keepers -----------------------------------------------------------------------
    def _start_keeper(self, index: int) -> None:
        t = threading.Thread(target=self._keep, args=(index,), name=f"yolopipe-keeper-{index}", daemon=True)
        t.start()
        self._keepers.append(t)

    def _wait_first(self, index: int, stop: threading.Event) -> None:
        while not self._first_done[index].wait(0.1):
            if stop.is_set():
                raise _Stopping
        if self._first[index].error is not None:
            raise self._first[index].error

    def _keep(self, index: int) -> None:
        try:
            self._keep_running(index)
        except BaseException as exc:  # noqa: BLE001 (a keeper must never die silently before its first start)
            if not self._first_done[index].is_set():
                self._first[index] = _Started(error=YolopipeError(f"inference worker {index} could not start: {exc}"))
                self._first_done[index].set()
            if not isinstance(exc, _Stopping):
                log.error("keeper of inference worker %d failed", index, exc_info=exc)

    def _keep_running(self, index: int) -> None:
        generation, backoff = 0, 0.0
        standby: tuple[Any, Any, Any] | None = None  # (process, report, promote) warming or waiting
        try:
            while not self._stopping.is_set():
                if standby is not None and standby[0].is_alive():
                    proc, report, promote = standby
                    standby = None
                    with self._lock:
                        self._standbys.pop(index, None)
                        self._procs[index] = proc
                    promote.send(generation)
                    promote.close()
                else:
                    if standby is not None:  # died while waiting: start from scratch
                        self._reap(standby)
                        standby = None
                    proc, report = self._spawn(index, generation)
                started = time.monotonic()
                outcome = self._await_ready(index, proc, report)
                if outcome.error is None and self.settings.standby and not self._stopping.is_set():
                    standby = self._spawn_standby(index, generation + 1)
                backoff = self._serve_until_it_ends(index, generation, proc, report, outcome, started, backoff,
                                                    warm=standby is not None)
                if backoff is None:
                    return
                generation += 1
        finally:
            if standby is not None:
                self._reap(standby)

    def _serve_until_it_ends(self, index: int, generation: int, proc: Any, report: Any, outcome: _Started,
                             started: float, backoff: float, *, warm: bool) -> float | None:
        """The pause before the next start, or None when this keeper is done."""
        if generation == 0:
            self._first[index] = outcome
            self._first_done[index].set()
            if outcome.error is not None:
                proc.join()
                report.close()
                return None
        if outcome.error is None:
            wait([proc.sentinel])  # serving until it ends
        proc.join()
        report.close()
        if self._stopping.is_set():
            return None
        from app.ipc.metrics import mark_dead

        mark_dead(proc.pid, self.layout.metrics_dir)
        lived = time.monotonic() - started
        backoff = 0.0 if lived > _HEALTHY_S else min(_MAX_BACKOFF_S, max(0.5, 2 * backoff))
        if warm:
            log.error("inference worker %d (pid %d) ended with exit code %s after %.0f s; its standby takes over",
                      index, proc.pid, proc.exitcode, lived)
            return backoff
        log.error("inference worker %d (pid %d) ended with exit code %s after %.0f s; restarting in %.1f s",
                  index, proc.pid, proc.exitcode, lived, backoff)
        if self._stopping.wait(backoff):
            return None
        return backoff

    def _spawn_standby(self, index: int, generation: int) -> tuple[Any, Any, Any] | None:
        """A warm standby for worker ``index``: (process, report, promote), or None while stopping."""
        promote_receive, promote_send = self._ctx.Pipe(duplex=False)
        try:
            proc, report = self._spawn(index, generation, promote=promote_receive)
        except _Stopping:
            return None
        finally:
            promote_receive.close()
        with self._lock:
            self._standbys[index] = proc
        return proc, report, promote_send

    def _reap(self, standby: tuple[Any, Any, Any]) -> None:
        proc, report, promote = standby
        promote.close()  # a waiting standby reads the end of the pipe and stops
        if not wait([proc.sentinel], 10.0):
            proc.kill()
        proc.join()
        report.close()

    def _spawn(self, index: int, generation: int, promote: Any = None) -> tuple[Any, Any]:
        receive, send = self._ctx.Pipe(duplex=False)
        spec = WorkerSpec(index, self.devices[index], self.layout, generation, os.getpid(), self.detector_factory)
        role = "standby" if promote is not None else "inference"
        proc = self._ctx.Process(target=worker_main, args=(spec, self.settings, send, promote),
                                 name=f"yolopipe-{role}-{index}", daemon=False)
        with self._lock:
            if self._stopping.is_set():
                raise _Stopping
            proc.start()
            if promote is None:
                self._procs[index] = proc
        send.close()
        return proc, receive

    def _await_ready(self, index: int, proc: Any, report: Any) -> _Started:
        while True:
            ready = wait([report, proc.sentinel])
            if report in ready:
                try:
                    message = report.recv()
                except EOFError:
                    message = None
                if message and message[0] == "standby":
                    continue  # warmed up; a "ready" follows once it is promoted
                if message and message[0] == "ready":
                    return _Started(info=message[1])
                if message and message[0] == "error":
                    return _Started(error=error_from_code(message[1], message[2]))
            if not proc.is_alive() or report in ready:
                proc.join()
                return _Started(error=YolopipeError(
                    f"inference worker {index} exited with code {proc.exitcode} while starting (see its log above)"))
