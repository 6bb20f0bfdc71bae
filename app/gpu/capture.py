"""The CUDA graph of one bucket: letterbox → engine → NMS → D2H of rows and counts.

All on the compute stream. The NMS reads the engine's output where the engine wrote it
(``__cuda_array_interface__``, no copy); the only device→host traffic is the final copy into
the slot's pinned results. A bucket's graph is captured once per slot (its staging, NMS and
results addresses are the slot's); the engine input and the graph memory pool are shared by
every slot, which is safe because all graphs replay on the one compute stream.

A batch of device NV12 frames (``app.gpu.nv12_input``) has its own graph per bucket: the
NV12 letterbox kernel in the letterbox's place, then the same engine, NMS and copies.

Profiling (``GpuPipeline.diagnose(profile=...)``): CUDA events cannot be recorded between the nodes of
one graph, so that path replays four graphs captured per stage (preprocess, engine, NMS, D2H)
with events between them. They run the same kernels on the same buffers as the full graph;
only the engine's head lives in a second tensor.

Every capture, and the eager warm-up runs before it, runs on one thread the builder owns
(``CaptureThread``), whichever thread asked for it (a warm-up, a batch that found its bucket's
graph missing, a slot re-captured after its staging grew). The kernels a graph holds are chosen
while it is captured (cuDNN keeps its choices per thread); captured on one thread with the
engine's choices pinned (``app.backends.torch_cuda``), the same image gets the same bytes of
answer in every slot, from every caller's thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from app.engine_contracts import DeviceEngine
from app.errors import DeviceError, YolopipeError
from app.gpu.memory import CapturedBatch, InputBuffer, StreamPair
from app.gpu.nv12_input import clear_params as clear_nv12_params
from app.gpu.nv12_input import launch_nv12_input
from app.gpu.preprocess import launch_letterbox
from app.gpu.slot import BatchSlot

log = logging.getLogger(__name__)

# Eager runs of a bucket before its first capture (kernel loading, cuDNN autotune, compile). They
# run on the capture thread, so a bucket already captured on another slot needs none: every
# kernel it launches is loaded and chosen, and a slot differs only in its buffers' addresses.
WARMUP_RUNS = 2
STAGES = ("preprocess", "engine", "nms", "d2h")
CAPTURE_TRIES = 3  # a capture invalidated by CUDA work outside the device's gate, tried again


def invalidated(exc: BaseException) -> bool:
    """Whether ``exc`` says a stream capture was invalidated or cut short (by other CUDA work)."""
    text = str(exc)
    return "StreamCapture" in text or "already recording" in text or ("capture" in text.lower() and "invalid" in text)


def graph_key(batch: int, nv12: bool = False) -> int | tuple[str, int]:
    """A slot's graphs by bucket; the NV12 batches' graphs apart from the images' ones."""
    return ("nv12", batch) if nv12 else batch


def key_parts(key: int | tuple[str, int]) -> tuple[int, bool]:
    """``graph_key``'s bucket and whether it is an NV12 batches' graph."""
    return (key[1], True) if isinstance(key, tuple) else (key, False)


class CaptureThread:
    """One thread that runs what is handed to it (``call``), one call at a time, in the context
    ``context()`` makes (the device, for torch and Numba), and hands back its result or error."""

    def __init__(self, context: Callable[[], Any] = contextlib.nullcontext, name: str = "yolopipe-capture") -> None:
        self._context = context
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is self._thread:  # already on it (a capture within a capture's call)
            return fn(*args, **kwargs)
        if not self._thread.is_alive():
            raise DeviceError("the GPU pipeline's capture thread is gone")
        done = threading.Event()
        box: list = []
        self._jobs.put((fn, args, kwargs, box, done))
        done.wait()
        ok, value = box[0]
        if ok:
            return value
        raise value

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, kwargs, box, done = job
            try:
                with self._context():
                    box.append((True, fn(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
                box.append((False, exc))
            finally:
                del fn, args, kwargs  # nothing of the job outlives it here
                done.set()


class GraphBuilder:
    """Captures the graphs of every slot on its one ``CaptureThread``; call only with the
    pipeline's gate held exclusively."""

    def __init__(self, engine: DeviceEngine, inputs: InputBuffer, compute: StreamPair, slots: list[BatchSlot],
                 context: Callable[[], Any] = contextlib.nullcontext) -> None:
        import torch

        self._torch = torch
        self.engine = engine
        self.inputs = inputs
        self.compute = compute
        self.slots = slots
        self.pool = None  # made on the capture thread, with the first capture
        self.thread = CaptureThread(context)

    def close(self) -> None:
        self.thread.close()

    def _live_pool(self):
        """The graph pool, new if every graph that used it is gone: torch releases a private
        pool with its last graph, and a capture into a released pool's handle fails."""
        if self.pool is None or not any(slot.graphs.by_batch for slot in self.slots):
            self.pool = self._torch.cuda.graph_pool_handle()
        return self.pool

    # -------------------------------------------------------------------- the steps
    def _preprocess(self, slot: BatchSlot, batch: int, nv12: bool = False) -> None:
        _, input_nb = self.inputs.bucket(batch)
        if nv12:
            launch_nv12_input(slot.staging, input_nb, batch, self.compute.numba)
            return
        launch_letterbox(
            slot.staging.nb_staging, slot.staging.nb_params, input_nb, batch, stream=self.compute.numba
        )

    def _engine(self, batch: int):
        input_t, _ = self.inputs.bucket(batch)
        return self.engine.forward(input_t)

    def _nms(self, slot: BatchSlot, head, batch: int) -> None:
        slot.nms.run(head, batch, stream=self.compute.numba)

    def _d2h(self, slot: BatchSlot, batch: int) -> None:
        slot.results.enqueue_copy(slot.nms.out_rows, slot.nms.out_count, batch, self.compute.numba)

    def _all(self, slot: BatchSlot, batch: int, nv12: bool = False):
        self._preprocess(slot, batch, nv12)
        head = self._engine(batch)
        self._nms(slot, head, batch)
        self._d2h(slot, batch)
        return head

    # ----------------------------------------------------------------------- capture
    def captured(self, slot: BatchSlot, batch: int, *, profile: bool, raw_exec: bool, nv12: bool = False
                 ) -> CapturedBatch:
        """The bucket's graph on ``slot``, captured if missing (and its stage graphs if asked)."""
        key = graph_key(batch, nv12)
        captured = slot.graphs.get(key)
        if captured is None:
            captured = self.thread.call(self._capture, slot, batch, raw_exec, nv12)
            slot.graphs.add(captured, key)
        if profile and not captured.stage_graphs:
            self.thread.call(self._capture_stages, slot, captured, nv12)
        return captured

    def _capture(self, slot: BatchSlot, batch: int, raw_exec: bool, nv12: bool = False) -> CapturedBatch:
        """The bucket's graph; a capture something outside the device's gate invalidated (a native
        thread of a library, such as a threaded NVDEC reader's) is tried again, in a fresh pool."""
        key = graph_key(batch, nv12)
        warm = any(other is not slot and other.graphs.get(key) is not None for other in self.slots)
        for attempt in range(1, CAPTURE_TRIES + 1):
            try:
                graph, head = self._capture_once(slot, batch, nv12, 0 if warm and attempt == 1 else WARMUP_RUNS)
                break
            except YolopipeError:
                raise
            except Exception as exc:
                self._abandon_pool()
                if attempt < CAPTURE_TRIES and invalidated(exc):
                    log.warning("GPU pipeline: the capture of batch %d was invalidated by other CUDA work (%s); "
                                "capturing it again", batch, exc)
                    continue
                raise DeviceError(
                    f"capturing the CUDA graph of batch {batch} failed: {type(exc).__name__}: {exc}"
                ) from exc
        graph_exec = self._graph_exec(graph) if raw_exec else None
        return CapturedBatch(batch=batch, graph=graph, head=head, graph_exec=graph_exec)

    def _capture_once(self, slot: BatchSlot, batch: int, nv12: bool, warmup_runs: int):
        torch = self._torch
        stream = self.compute.torch
        if nv12:
            clear_nv12_params(slot.staging)
        try:
            with torch.cuda.stream(stream):
                for _ in range(warmup_runs):
                    self._all(slot, batch, nv12)
            stream.synchronize()
            slot.nms.forget_views()  # the warm-ups' heads go back to the allocator now
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA call never fails because of this capture; the gate
            # keeps every thread that knows of it (pipelines, NVDEC readers) quiet meanwhile.
            with torch.cuda.graph(graph, pool=self._live_pool(), stream=stream, capture_error_mode="thread_local"):
                head = self._all(slot, batch, nv12)
            stream.synchronize()
        finally:
            slot.nms.forget_views()  # the captured head is its CapturedBatch's alone, freed with it
        return graph, head

    def _abandon_pool(self) -> None:
        """After a failed capture: torch may still count its pool as being recorded into (its
        end of capture raised before it said so), and the next capture into it would fail with
        "already recording". End that recording (not the pool: graphs captured before hold it),
        and capture into a new pool from now on."""
        pool, self.pool = self.pool, None
        end = getattr(getattr(self._torch, "_C", None), "_cuda_endAllocateToPool", None)
        if pool is not None and end is not None:
            with contextlib.suppress(Exception):  # nothing was left recording
                end(self.compute.device, pool)

    @staticmethod
    def _graph_exec(graph) -> ctypes.c_void_p | None:
        """The graph's ``CUgraphExec`` for ``cuGraphLaunch``; None keeps this graph on ``replay()``.

        Launching the exec handle directly skips what ``CUDAGraph.replay()`` adds around
        ``cudaGraphLaunch``: Python replay hooks and the RNG prologue, which advances the
        Philox offsets of generators used inside the graph. These graphs use no RNG (letterbox,
        inference-mode model, NMS, copies), so nothing is skipped that they need.
        """
        try:
            handle = int(graph.raw_cuda_graph_exec())
        except Exception as exc:  # noqa: BLE001 - this graph goes through replay() instead
            log.warning("GPU pipeline: no raw graph exec handle (%s: %s); replaying through torch", type(exc).__name__, exc)
            return None
        return ctypes.c_void_p(handle) if handle else None

    def _capture_stages(self, slot: BatchSlot, captured: CapturedBatch, nv12: bool = False) -> None:
        torch = self._torch
        stream = self.compute.torch
        batch = captured.batch
        graphs: dict[str, Any] = {name: torch.cuda.CUDAGraph() for name in STAGES}
        self._live_pool()
        with torch.cuda.graph(graphs["preprocess"], pool=self.pool, stream=stream):
            self._preprocess(slot, batch, nv12)
        with torch.cuda.graph(graphs["engine"], pool=self.pool, stream=stream):
            head = self._engine(batch)
        with torch.cuda.graph(graphs["nms"], pool=self.pool, stream=stream):
            self._nms(slot, head, batch)
        with torch.cuda.graph(graphs["d2h"], pool=self.pool, stream=stream):
            self._d2h(slot, batch)
        stream.synchronize()
        slot.nms.forget_views()
        captured.stage_graphs = graphs
        captured.stage_head = head
