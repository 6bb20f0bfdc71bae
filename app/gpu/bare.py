"""The engine alone, for benchmarks (``GpuPipeline.diagnose(bare=...)``): an already letterboxed
batch on the device, the engine captured in a CUDA graph of its own, each replay timed on the
host (replay + stream sync) and on the device (CUDA events). The caller holds the device alone
(the capture calls ``engine.forward``, which is never called concurrently)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from app.contracts import BareRun, measure_once
from app.engine_contracts import DeviceEngine


def engine_alone(engine: DeviceEngine, batch: np.ndarray,
                 measure: Callable[[Callable[[], object]], list[float]] = measure_once) -> BareRun:
    """``batch``: ``[B, 3, S, S]`` float32 RGB in [0, 1] on the host; ``measure(call)``: the ms of
    each timed call."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float16 if engine.input_dtype == "float16" else torch.float32
    inp = torch.from_numpy(batch).to(device, dtype).contiguous()
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    device_ms: list[float] = []
    try:
        with torch.cuda.stream(stream):
            for _ in range(3):
                engine.forward(inp)
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                engine.forward(inp)
            stream.synchronize()

            def call() -> None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                graph.replay()
                end.record(stream)
                stream.synchronize()
                device_ms.append(start.elapsed_time(end))

            times = measure(call)
    finally:
        graph.reset()
    return BareRun(times, device_ms[-len(times):] if times else [])
