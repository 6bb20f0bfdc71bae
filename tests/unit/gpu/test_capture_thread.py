"""Every graph is captured on the builder's one capture thread, whoever asks (``GraphBuilder.
captured``: warm-ups, batches that found a graph missing, slots re-captured after growing).

The engine here stands in for cuDNN: it picks its kernels once per calling thread, as cuDNN
keeps its choices per thread. Captured from the callers' threads, the graphs of one bucket
would hold different kernels (and move an image's scores with its slot); captured on one
thread they all hold the same. The real CUDA calls are stood in for (no GPU here); the
builder's own capture steps (warm-up runs, then the capture of the same steps) run as written.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import types

import pytest

from app.errors import DeviceError
from app.gpu.capture import GraphBuilder
from app.gpu.memory import CapturedGraphs


class PerThreadKernels:
    """An engine whose kernel choice is made per calling thread (cuDNN's is)."""

    name = "stand-in"

    def __init__(self) -> None:
        self._local = threading.local()
        self._ids = itertools.count()
        self.threads: set[int] = set()
        self.fail_next = False

    def forward(self, images):
        self.threads.add(threading.get_ident())
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("out of memory")
        if not hasattr(self._local, "kernel"):
            self._local.kernel = next(self._ids)
        return {"kernel": self._local.kernel}


class Builder(GraphBuilder):
    """The builder with its device steps (letterbox kernel, NMS, copies) as no-ops."""

    def __init__(self, engine, slots, context=contextlib.nullcontext) -> None:
        super().__init__(engine, types.SimpleNamespace(bucket=lambda batch: ("input", None)),
                         types.SimpleNamespace(torch=types.SimpleNamespace(synchronize=lambda: None), numba=None,
                                               device=0),
                         slots, context=context)
        self._torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
            stream=lambda stream: contextlib.nullcontext(), graph_pool_handle=object,
            CUDAGraph=lambda: types.SimpleNamespace(reset=lambda: None),
            graph=lambda graph, pool=None, stream=None, capture_error_mode=None: contextlib.nullcontext()))

    def _preprocess(self, slot, batch, nv12=False):
        pass

    def _nms(self, slot, head, batch):
        pass

    def _d2h(self, slot, batch):
        pass


class ViewCache:
    """A slot's NMS as far as a capture sees it: how often it was told to forget its head views."""

    def __init__(self) -> None:
        self.forgotten = 0

    def forget_views(self) -> None:
        self.forgotten += 1


@pytest.fixture
def builder():
    slots = [types.SimpleNamespace(index=i, graphs=CapturedGraphs(), nms=ViewCache()) for i in range(3)]
    b = Builder(PerThreadKernels(), slots)
    yield b
    b.close()


def test_captures_asked_for_from_many_threads_all_run_on_the_capture_thread(builder):
    asks = [(slot, batch) for slot in builder.slots for batch in (1, 2, 4, 8)]
    start = threading.Barrier(len(asks), timeout=10)
    callers: set[int] = set()

    def ask(slot, batch):
        callers.add(threading.get_ident())
        start.wait()
        builder.captured(slot, batch, profile=False, raw_exec=False)

    threads = [threading.Thread(target=ask, args=a) for a in asks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert builder.engine.threads == {builder.thread.ident}
    assert builder.thread.ident not in callers
    heads = [slot.graphs.get(batch).head for slot, batch in asks]
    assert len(heads) == 12 and all(h == {"kernel": 0} for h in heads)  # one choice in every graph
    # each capture dropped the NMS's views twice: the warm-ups' heads, then the graph's own
    assert [slot.nms.forgotten for slot in builder.slots] == [8, 8, 8]


def test_a_bucket_warms_up_once_and_its_captures_on_other_slots_start_at_once(builder, monkeypatch):
    """Eager warm-ups load and choose the bucket's kernels on the capture thread; once one slot
    holds the bucket's graph, another slot's capture of it runs only the captured steps."""
    from app.gpu import capture
    from app.gpu.capture import WARMUP_RUNS

    monkeypatch.setattr(capture, "clear_nv12_params", lambda staging: None)  # the NV12 staging's device step
    for slot in builder.slots:
        slot.staging = None
    calls = []
    forward = builder.engine.forward
    builder.engine.forward = lambda images: calls.append(1) or forward(images)

    def runs(slot, batch, nv12=False):
        before = len(calls)
        builder.captured(slot, batch, profile=False, raw_exec=False, nv12=nv12)
        return len(calls) - before

    first, second, third = builder.slots
    assert runs(first, 4) == WARMUP_RUNS + 1 >= 2
    assert [runs(second, 4), runs(third, 4)] == [1, 1]
    assert runs(second, 8) == WARMUP_RUNS + 1  # another bucket warms up again
    assert runs(first, 4, nv12=True) == WARMUP_RUNS + 1  # and so do NV12 batches' graphs of a bucket
    first.graphs.free()  # a slot's graphs dropped (its staging grew), captured again: the others hold 4
    assert runs(first, 4) == 1
    second.graphs.free()  # the one slot that held 8
    assert runs(third, 8) == WARMUP_RUNS + 1


def test_a_capture_that_fails_is_the_callers_device_error_and_the_thread_goes_on(builder):
    builder.engine.fail_next = True
    with pytest.raises(DeviceError, match="capturing the CUDA graph of batch 4 failed: RuntimeError: out of memory"):
        builder.captured(builder.slots[0], 4, profile=False, raw_exec=False)
    assert builder.slots[0].graphs.get(4) is None
    builder.captured(builder.slots[0], 4, profile=False, raw_exec=False)
    assert builder.slots[0].graphs.get(4).head == {"kernel": 0}


def test_each_capture_runs_in_the_pipelines_device_context_on_the_capture_thread():
    entered: list[int] = []

    @contextlib.contextmanager
    def on_device():
        entered.append(threading.get_ident())
        yield

    slots = [types.SimpleNamespace(index=0, graphs=CapturedGraphs(), nms=ViewCache())]
    b = Builder(PerThreadKernels(), slots, context=on_device)
    try:
        for batch in (1, 2):
            b.captured(slots[0], batch, profile=False, raw_exec=False)
        assert entered == [b.thread.ident] * 2
    finally:
        b.close()
    with pytest.raises(DeviceError, match="capture thread is gone"):
        b.captured(slots[0], 4, profile=False, raw_exec=False)


INVALIDATED = ("CUDA error: operation failed due to a previous error during capture "
               "(cudaErrorStreamCaptureInvalidated)")  # what the H200 said while NVDEC readers decoded


class Invalidated(Builder):
    """A builder whose first ``failures`` captures end in ``error``, as the driver's end of an
    invalidated capture does; it notes each capture's pool and mode, and the pools whose
    recording torch was told to end."""

    def __init__(self, failures: int, error: str = INVALIDATED) -> None:
        super().__init__(PerThreadKernels(), [types.SimpleNamespace(index=0, graphs=CapturedGraphs(), nms=ViewCache())])
        self.left, self.error = failures, error
        self.captures: list[tuple[object, str]] = []
        self.ended: list[object] = []
        pools = itertools.count()

        @contextlib.contextmanager
        def graph(graph, pool=None, stream=None, capture_error_mode=None):
            self.captures.append((pool, capture_error_mode))
            yield
            if self.left > 0:
                self.left -= 1
                raise RuntimeError(self.error)

        self._torch.cuda.graph = graph
        self._torch.cuda.graph_pool_handle = lambda: next(pools)
        self._torch._C = types.SimpleNamespace(_cuda_endAllocateToPool=lambda device, pool: self.ended.append(pool))


def test_an_invalidated_capture_is_captured_again_in_a_fresh_pool():
    b = Invalidated(failures=1)
    try:
        b.captured(b.slots[0], 4, profile=False, raw_exec=False)
        assert b.slots[0].graphs.get(4) is not None
        # The failed capture's pool had its recording ended (torch would refuse the next capture
        # into it: "already recording"); the second capture went into a new pool.
        assert b.captures == [(0, "thread_local"), (1, "thread_local")]
        assert b.ended == [0]
    finally:
        b.close()


def test_a_capture_invalidated_every_time_is_a_device_error_after_its_tries():
    from app.gpu.capture import CAPTURE_TRIES

    b = Invalidated(failures=99)
    try:
        with pytest.raises(DeviceError, match="capturing the CUDA graph of batch 2 failed: .*Invalidated"):
            b.captured(b.slots[0], 2, profile=False, raw_exec=False)
        assert len(b.captures) == CAPTURE_TRIES and b.slots[0].graphs.get(2) is None
    finally:
        b.close()


def test_a_capture_that_fails_otherwise_is_not_tried_again():
    b = Invalidated(failures=1, error="CUDA error: out of memory")
    try:
        with pytest.raises(DeviceError, match="out of memory"):
            b.captured(b.slots[0], 2, profile=False, raw_exec=False)
        assert len(b.captures) == 1 and b.ended == [0]
        b.captured(b.slots[0], 2, profile=False, raw_exec=False)  # the next capture, in a new pool
        assert b.captures[-1] == (1, "thread_local")
    finally:
        b.close()
