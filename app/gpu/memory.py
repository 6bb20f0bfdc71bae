"""Owners of the GPU pipeline's device resources, each with a clear lifetime and an idempotent
``free()``.

=====================  ======================================================================
``StreamPair``         a non-default torch stream and its Numba alias (the compute stream)
``Staging``            pinned host + device ``uint8`` staging: ``[params header | images]``;
                       one H2D copy moves both the per-image params and the pixels
``InputBuffer``        the engine input ``[max_batch, 3, S, S]``; bucket ``b`` is its first
                       ``b`` images (contiguous), so every bucket's graph writes in place
``HostResults``        pinned host ``[max_batch, max_det, 6]`` rows + ``[max_batch]`` counts,
                       the target of the one D2H copy per batch
``CapturedGraphs``     the CUDA graphs per bucket and the tensors they must keep alive
=====================  ======================================================================

The pipeline holds a ``Staging``, ``HostResults`` and ``CapturedGraphs`` per *batch slot*
(``app.gpu.slot``): slots are batches in flight, so these are never shared between them. The
engine input and the graphs' memory pool are shared: every graph runs on the one compute
stream, so two graphs never run at the same time.

Why the staging is grown instead of sized for the worst case: image sizes are unbounded, and a
worst-case pinned buffer (128 × 4K frames) would be gigabytes. Growing means the graphs that
baked in the old addresses are dropped and re-captured on their next use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import cuda

from app.gpu.preprocess import PARAMS_PER_IMAGE

ALIGN = 256  # start of every region in the staging buffer


def align_up(n: int, to: int = ALIGN) -> int:
    return -(-int(n) // to) * to


class StreamPair:
    """A torch CUDA stream and the same stream seen by Numba (``cuda.external_stream``)."""

    def __init__(self, device: int) -> None:
        import torch

        self.device = device
        self.torch = torch.cuda.Stream(device=device)
        self.numba = cuda.external_stream(self.torch.cuda_stream)

    def synchronize(self) -> None:
        if self.torch is not None:
            self.torch.synchronize()

    def free(self) -> None:
        if self.torch is None:
            return
        self.torch.synchronize()
        self.torch = None
        self.numba = None


class Staging:
    """Pinned host and device staging buffers with the same layout.

    ``[0, header_bytes)``: per-image params, int64 ``[max_batch, PARAMS_PER_IMAGE]``;
    ``[header_bytes, header_bytes + capacity)``: image bytes at the offsets the params name.
    """

    def __init__(self, max_batch: int, capacity: int, device: int) -> None:
        import torch

        self.max_batch = max_batch
        self.device = device
        self.header_bytes = align_up(max_batch * PARAMS_PER_IMAGE * 8)
        self.capacity = align_up(capacity)
        total = self.header_bytes + self.capacity
        self.host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        # The device half is its own allocation (cuMemAlloc through Numba, like the NMS buffers),
        # not a block of torch's caching allocator: there it shared segments with longer-lived
        # blocks, so shrinking it back could land it in a new 20 MiB segment and leave the device
        # holding more than before the burst (the GPU suite of 2026-12-07). Freed, it goes back
        # to the driver whole; torch sees it as a tensor through the CUDA array interface.
        self.nb_staging = cuda.device_array(total, np.uint8)
        self.dev = torch.as_tensor(self.nb_staging, device=torch.device("cuda", device))
        self.host_np = self.host.numpy()
        n_params = max_batch * PARAMS_PER_IMAGE
        self.host_params = self.host_np[: self.header_bytes].view(np.int64)[:n_params].reshape(max_batch, -1)
        dev_params = (
            self.dev[: self.header_bytes].view(torch.int64)[:n_params].view(max_batch, PARAMS_PER_IMAGE)
        )
        # Numba views made once: converting a torch tensor per launch costs ~36 µs of host time.
        self.nb_params = cuda.as_cuda_array(dev_params, sync=False)

    def free(self) -> None:
        """Drop every reference; Numba frees the device half at its next flush of deallocations
        (``release_device_memory`` forces one)."""
        self.nb_staging = self.nb_params = None
        self.host_np = self.host_params = None
        self.host = self.dev = None


def release_device_memory() -> None:
    """Give the driver back what was freed: Numba's pending deallocations (staging dropped by
    ``Staging.free``), then torch's cached device blocks and pinned host blocks. Synchronous:
    call it with no batch in flight."""
    import torch

    cuda.current_context().deallocations.clear()
    torch.cuda.empty_cache()
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks
    if host_empty_cache is not None:
        host_empty_cache()


class InputBuffer:
    """The engine input for every bucket: one allocation, bucket ``b`` = its first ``b`` images."""

    def __init__(self, max_batch: int, size: int, dtype: str, device: int) -> None:
        import torch

        torch_dtype = {"float32": torch.float32, "float16": torch.float16}[dtype]
        self.tensor = torch.empty(
            (max_batch, 3, size, size), dtype=torch_dtype, device=torch.device("cuda", device)
        )
        self._views: dict[int, tuple[Any, Any]] = {}

    def bucket(self, batch: int) -> tuple[Any, Any]:
        """``(torch view, Numba view)`` of the first ``batch`` images, made once per bucket."""
        views = self._views.get(batch)
        if views is None:
            t = self.tensor[:batch]
            views = (t, cuda.as_cuda_array(t, sync=False))
            self._views[batch] = views
        return views

    def free(self) -> None:
        self._views.clear()
        self.tensor = None


class HostResults:
    """Pinned host rows/counts: where the one D2H copy per batch lands (Numba pinned memory,
    so the copy is a plain ``cuMemcpyDtoHAsync`` that a CUDA graph can capture)."""

    def __init__(self, max_batch: int, max_det: int) -> None:
        self.rows = cuda.pinned_array((max_batch, max_det, 6), np.float32)
        self.counts = cuda.pinned_array(max_batch, np.int32)

    def enqueue_copy(self, dev_rows, dev_counts, batch: int, stream) -> None:
        """Copy the first ``batch`` images' rows and counts from the device, async on ``stream``."""
        dev_rows[:batch].copy_to_host(self.rows[:batch], stream=stream)
        dev_counts[:batch].copy_to_host(self.counts[:batch], stream=stream)

    def free(self) -> None:
        self.rows = self.counts = None


@dataclass
class CapturedBatch:
    """One bucket's graph and what it must keep alive (its head output lives in the graph pool)."""

    batch: int
    graph: Any  # torch.cuda.CUDAGraph
    head: Any  # the engine output tensor the NMS reads in place
    graph_exec: Any = None  # ctypes.c_void_p: the graph's CUgraphExec for cuGraphLaunch, or None
    stage_graphs: dict[str, Any] = field(default_factory=dict)  # profiling: one graph per stage
    stage_head: Any = None

    def free(self) -> None:
        for g in [self.graph, *self.stage_graphs.values()]:
            if g is not None:
                g.reset()
        self.graph = self.graph_exec = None  # the exec handle dies with the graph
        self.stage_graphs.clear()
        self.head = self.stage_head = None


class CapturedGraphs:
    """One slot's captured graphs, per bucket; each graph's output is held here. Their memory
    comes from the pipeline's one graph pool, safe because all graphs replay on one stream."""

    def __init__(self) -> None:
        self.by_batch: dict[int, CapturedBatch] = {}

    def get(self, batch: int | tuple[str, int]) -> CapturedBatch | None:
        return self.by_batch.get(batch)

    def add(self, captured: CapturedBatch, key: int | tuple[str, int] | None = None) -> None:
        """Under its bucket, or ``key`` (``app.gpu.capture.graph_key``: NV12 batches have their own)."""
        self.by_batch[captured.batch if key is None else key] = captured

    def free(self) -> None:
        for captured in self.by_batch.values():
            captured.free()
        self.by_batch.clear()
