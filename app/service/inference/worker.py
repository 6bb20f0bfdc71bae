"""The inference worker: one process per GPU (or per CPU worker) that owns the detector.

It listens on a Unix socket in the run folder; every HTTP worker connects, names its
shared-memory ring (``HELLO``), then sends image descriptors (``IMAGE``). The
batcher batches images from every HTTP worker and each answer goes back on the socket it came
from, a batch's answers to one HTTP worker in one frame (``app.service.inference.answers``).
Its hello tells every HTTP worker the model and the run shape (``max_batch``, ``in_flight``,
``max_pixels``) as the detector was opened with it. Its load goes to a status block the
HTTP workers read. SIGTERM: refuse new work, finish the admitted work, exit 0; SIGINT is
ignored (a terminal's Ctrl-C reaches every process; the supervisor decides the order). A
device that became unusable (the batcher's ``on_fatal``) drains the same way and exits with
``EXIT_DEVICE_LOST``, for the pool to start a fresh process.

Neither torch nor prometheus_client is imported at module level: the process entry first
sets the environment they read (the GPU this worker may see, the metrics folder).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.errors import YolopipeError
from app.heap import limit_malloc_arenas
from app.ipc import wire
from app.ipc.answers import Answers, answers_frame
from app.ipc.layout import RunLayout
from app.ipc.ring import map_ring
from app.service.inference.answers import answer_frames, failed_answers
from app.service.inference.batcher import Batcher, Job
from app.service.memory import IdleRelease, release_memory
from app.types import StartupSteps, process_age_s

log = logging.getLogger("yolopipe.serving")

EXIT_DEVICE_LOST = 4  # the device context died: the pool starts this worker again

# What opens a worker's detector from the settings (and reports its start-up steps): by default
# ``app.runtime``'s ``ensure_artifacts`` then ``open_model_dir``; a benchmark or test may pass its
# own to the service (``serve``, ``InferencePool``, ``create_service_app``): e.g. ``bench/emulated_device.py``'s,
# which emulates the device. It travels to the spawned worker by pickle, so it must be a
# module-level function (or a ``functools.partial`` of one), which the worker imports by name.
DetectorFactory = Callable[[Any, StartupSteps], Any]


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    device: str | None  # the CUDA_VISIBLE_DEVICES entry this worker sees, None on the CPU
    layout: RunLayout
    generation: int  # how many times this worker index was started before
    parent_pid: int
    detector_factory: DetectorFactory | None = None  # None: app.runtime's ensure_artifacts, then open_model_dir


def worker_main(spec: WorkerSpec, settings: Any, report: Any, promote: Any = None) -> None:
    """Process entry (multiprocessing, spawn). ``report``: a pipe to the pool, which gets
    ``("ready", info)`` or ``("error", code, message)``. With ``promote`` (a pipe from the
    pool) this is a standby: it opens and warms its detector, reports ``("standby", pid)``,
    and takes over the worker's socket only when the pool sends it a generation number."""
    from app.bytecode import keep_bytecode

    keep_bytecode()  # before the imports below bring torch (the supervisor's choice, passed on)
    from app.runtime import ensure_artifacts, open_model_dir, options_from
    from app.service.processes import die_with_parent, run_event_loop, setup_logging, write_metrics_to

    die_with_parent(spec.parent_pid)
    limit_malloc_arenas(2)  # before the decode and backend threads start: see app.service.memory
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    write_metrics_to(spec.layout.metrics_dir)
    if spec.device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.device
        settings = settings.model_copy(update={"device": 0})
    setup_logging()
    steps = StartupSteps()
    phase = None
    if promote is None:  # a first start (or a restart without a standby) says what it is doing
        phase = wire.StatusBlock(spec.layout.status(spec.index), writable=True)
        phase.write_phase("preparing the model (a first start exports it, on a GPU builds its engine)")
        log.info("inference worker %d: preparing the model", spec.index)

        def opening(text: str) -> None:  # each step, and on a first start what is being built and how far
            phase.write_phase(text)
            log.info("inference worker %d: %s", spec.index, text)

        steps.listener = opening
    try:
        if spec.detector_factory is not None:
            detector = spec.detector_factory(settings, steps)
        else:
            options = options_from(settings)
            detector = open_model_dir(ensure_artifacts(options, steps), options, steps)
    except YolopipeError as exc:
        report.send(("error", exc.code, str(exc)))
        raise SystemExit(3) from None
    finally:
        steps.listener = None
        if phase is not None:
            phase.close()
    try:
        lost = run_event_loop(_serve(spec, settings, detector, report, promote, steps))
    finally:
        if not lost:  # a dead context cannot free anything: just exit
            detector.close()
    if lost:
        os._exit(EXIT_DEVICE_LOST)


async def _serve(spec: WorkerSpec, settings: Any, detector: Any, report: Any, promote: Any = None,
                 steps: StartupSteps | None = None) -> str | None:
    """Serve until SIGTERM (None) or until the device is lost (why). ``steps``: the start-up so
    far (opening the model), which the warm-up adds to; the hello reports them (``/readyz``)."""
    from app.service.inference.metrics import WorkerMetrics, gpu_memory_readers

    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    metrics = WorkerMetrics(str(spec.index))
    socket_path = spec.layout.socket(spec.index)
    connections: set[_Connection] = set()

    def deliver(jobs: list, answers: Answers) -> None:
        """On a batch thread: each HTTP worker's share of a batch as one frame, written by the loop
        (the stream host takes its share here)."""
        frames = answer_frames(jobs, answers)
        if frames:
            loop.call_soon_threadsafe(_send_frames, frames)

    batcher = Batcher(detector, budget_s=settings.budget_s, deliver=deliver, metrics=metrics,
                      generation=spec.generation)
    # A pipeline with buckets (the GPU's: each captured as a graph) warms up each, then its
    # smallest and largest batch; one without (ONNX Runtime) runs one image.
    buckets = detector.buckets
    sizes = tuple(sorted({1, detector.shape.max_batch})) if buckets else (1,)
    # A first start shows its warm-up steps (in the log and /readyz); a standby warms quietly
    # beside the worker that owns the status block.
    starting = None if promote is not None else wire.StatusBlock(spec.layout.status(spec.index), writable=True)

    steps = steps if steps is not None else StartupSteps()

    def progress(text: str) -> None:
        log.info("inference worker %d%s: %s", spec.index, "" if starting is not None else " standby", text)
        steps.begin(text)
        if starting is not None:
            starting.write_phase(text)

    await asyncio.to_thread(batcher.start, sizes, progress, buckets)
    steps.finish()
    release = functools.partial(release_memory, detector.release_memory)
    if starting is not None:
        starting.write_phase("")
        starting.close()
    generation = spec.generation
    if promote is not None:
        await asyncio.to_thread(release)  # it waits at this size: what opening and warming up left goes now
        generation = await _stand_by(spec, report, promote, stopping)
        if generation is None:  # stopped (or the pool went away) before taking over
            loop.remove_signal_handler(signal.SIGTERM)
            await asyncio.to_thread(batcher.close, 0.0)
            return None
        batcher.generation = generation
    if generation:
        metrics.restarts.labels(str(spec.index)).inc()
    # Only now: the status block and the socket belong to the worker that serves.
    status = wire.StatusBlock(spec.layout.status(spec.index), writable=True)
    idle = IdleRelease(settings.idle_release_s, release, busy=lambda: batcher.load().pending > 0)

    def on_load_change(load: wire.Load) -> None:
        status.write(load)
        idle.touch()

    batcher.on_load_change = on_load_change
    idle.start()
    idle.touch()  # a first start's warm-up garbage goes once it has been quiet (not before it is ready)
    info = {
        "worker": spec.index, "generation": generation, "pid": os.getpid(),
        "device": "cpu" if spec.device is None else f"cuda:{spec.device}",
        **detector.info(),
        "meta": asdict(detector.meta),
        "max_pixels": detector.shape.max_pixels,
        "max_det": detector.max_det,
        "in_flight": detector.shape.in_flight,
        "startup": {"steps": steps.as_json(), "worker_ready_after_s": _rounded(process_age_s())},
    }
    stop_sampling = threading.Event()
    metrics.sample_gpu_memory(gpu_memory_readers(detector, 0), 5.0, stop_sampling)

    def _send_frames(frames: list) -> None:
        for owner, data in frames:
            owner.send(data)

    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    server = await loop.create_unix_server(
        lambda: _Connection(batcher, info, connections), str(socket_path))
    from app.service.inference.streams import StreamHost  # video streams: their own socket and thread

    streams = StreamHost(spec.index, settings, detector, spec.layout, loop, batcher)
    await streams.start()
    batcher.on_fatal = lambda reason: loop.call_soon_threadsafe(stopping.set)
    status.write(batcher.load())
    report.send(("ready", info))
    log.info("inference worker %d ready: %s on %s/%s (%s), batch %d, %d in flight", spec.index, detector.meta.name,
             info["backend"], info["precision"], info["device"], detector.shape.max_batch, detector.shape.in_flight)
    await stopping.wait()

    log.info("inference worker %d draining%s", spec.index, " (device lost)" if batcher.fatal else "")
    await idle.stop()
    server.close()
    await streams.close()
    # After a device loss the running batches can only fail: do not wait for them long.
    await asyncio.to_thread(batcher.close, 1.0 if batcher.fatal else settings.request_timeout_s)
    status.write(batcher.load())
    await asyncio.sleep(0)  # let the last answers go out
    for conn in list(connections):
        conn.close()
    await asyncio.sleep(0)  # connection_lost runs
    batcher.on_load_change = None
    stop_sampling.set()
    status.close()
    loop.remove_signal_handler(signal.SIGTERM)
    log.info("inference worker %d stopped", spec.index)
    return batcher.fatal


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 2)


async def _stand_by(spec: WorkerSpec, report: Any, promote: Any, stopping: asyncio.Event) -> int | None:
    """Warm and waiting: the generation to serve as once the pool promotes this process, or
    None when it is stopped first."""
    loop = asyncio.get_running_loop()
    promoted: asyncio.Future = loop.create_future()

    def on_message() -> None:
        loop.remove_reader(promote.fileno())
        try:
            promoted.set_result(promote.recv())
        except (EOFError, OSError):  # the pool is gone
            promoted.set_result(None)

    loop.add_reader(promote.fileno(), on_message)
    marker = wire.StatusBlock(spec.layout.status(spec.index), writable=True)
    marker.write_standby(os.getpid())  # for operators and benchmarks: the worker has a warm standby
    report.send(("standby", os.getpid()))
    log.info("inference worker %d standby ready (pid %d)", spec.index, os.getpid())
    stopped = asyncio.ensure_future(stopping.wait())
    await asyncio.wait((promoted, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    marker.write_standby(0)  # taking over, or leaving: no standby ready now
    marker.close()
    if not promoted.done():
        loop.remove_reader(promote.fileno())
        return None
    if promoted.result() is not None:
        log.info("inference worker %d standby (pid %d) takes over", spec.index, os.getpid())
    return promoted.result()


class _Connection(asyncio.Protocol):
    """One HTTP worker, as the inference worker sees it."""

    def __init__(self, batcher: Any, info: dict, connections: set) -> None:
        self.batcher = batcher
        self.info = info
        self.connections = connections
        self.reader = wire.FrameReader()
        self.ring: memoryview | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self.transport = None
        self.batcher.drop_owner(self)
        self.ring = None  # unmapped once the last job's view of it is gone

    def send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        jobs: list[Job] = []  # admitted together, after the frames before them
        for kind, body in self.reader.feed(data):
            if kind == wire.IMAGE and self.ring is not None:
                ref = wire.read_image(body)
                jobs.append(Job(self, ref, self.ring[ref.offset : ref.offset + ref.length]))
                continue
            self._admit(jobs)
            jobs = []
            if kind == wire.CANCEL:
                self.batcher.cancel(self, wire.read_cancel(body))
            elif kind == wire.HELLO:
                self.ring = map_ring(Path(wire.read_hello(body)["ring"]))
                self.send(wire.hello(self.info))
            else:
                log.error("unexpected frame kind %d from an HTTP worker; closing its connection", kind)
                self.close()
                return
        self._admit(jobs)

    def _admit(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        refused = [(job, error) for job, error in zip(jobs, self.batcher.admit_many(jobs)) if error is not None]
        for job, _ in refused:
            job.data = None
        if refused:
            self.send(answers_frame(failed_answers([j for j, _ in refused], [e for _, e in refused])))
