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
                         types.SimpleNamespace(torch=types.SimpleNamespace(synchronize=lambda: None), numba=None),
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


@pytest.fixture
def builder():
    slots = [types.SimpleNamespace(index=i, graphs=CapturedGraphs()) for i in range(3)]
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

    slots = [types.SimpleNamespace(index=0, graphs=CapturedGraphs())]
    b = Builder(PerThreadKernels(), slots, context=on_device)
    try:
        for batch in (1, 2):
            b.captured(slots[0], batch, profile=False, raw_exec=False)
        assert entered == [b.thread.ident] * 2
    finally:
        b.close()
    with pytest.raises(DeviceError, match="capture thread is gone"):
        b.captured(slots[0], 4, profile=False, raw_exec=False)
