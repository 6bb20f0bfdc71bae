"""The CUDA driver calls of the hot path, made straight through ``libcuda.so.1`` (ctypes).

Why: per batch the GPU pipeline enqueues one H2D copy of its staging buffer (on the copy
stream), one graph launch (on the compute stream) and the events that order them. Through
torch that is ``Tensor.copy_(non_blocking=True)`` + ``CUDAGraph.replay()`` + event calls,
about 60 µs of host time at batch 1 (dispatcher, stream guards, Python hooks). The driver
calls themselves cost about a microsecond each from ctypes, with every pointer and handle
computed once beforehand. The calls that wait (``cuEventSynchronize``) release the GIL, so a
thread blocked there lets the others run; the short ones keep it (see ``_RELEASE_GIL``).

Only the driver is touched: the handles come from torch (``Tensor.data_ptr()``,
``Stream.cuda_stream``, ``CUDAGraph.raw_cuda_graph_exec()``), whose runtime types
(``cudaStream_t``, ``cudaGraphExec_t``) are the driver's (``CUstream``, ``CUgraphExec``), and
everything lives in the device's primary context, the one torch and Numba use.

Every return code is checked; a failure becomes ``DeviceError`` naming the ``CUresult``
(``cuGetErrorName``). Loading the library or a symbol failing is a ``DeviceError`` too, which
callers treat as "use the torch path".
"""

from __future__ import annotations

import ctypes
import threading

from app.errors import DeviceError

LIBCUDA = "libcuda.so.1"
CUDA_SUCCESS = 0

_c_result = ctypes.c_int  # CUresult
_c_handle = ctypes.c_void_p  # CUcontext, CUstream, CUgraphExec: opaque pointers
_c_devptr = ctypes.c_uint64  # CUdeviceptr

# name → (argtypes); restype is CUresult for all of them.
_SIGNATURES: dict[str, tuple] = {
    "cuGetErrorName": (_c_result, ctypes.POINTER(ctypes.c_char_p)),
    "cuInit": (ctypes.c_uint,),
    "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_c_handle), ctypes.c_int),
    "cuDevicePrimaryCtxRelease_v2": (ctypes.c_int,),
    "cuCtxSetCurrent": (_c_handle,),
    "cuMemcpyHtoDAsync_v2": (_c_devptr, _c_handle, ctypes.c_size_t, _c_handle),
    "cuMemcpyDtoDAsync_v2": (_c_devptr, _c_devptr, ctypes.c_size_t, _c_handle),
    "cuGraphLaunch": (_c_handle, _c_handle),
    "cuStreamSynchronize": (_c_handle,),
    "cuEventRecord": (_c_handle, _c_handle),
    "cuEventSynchronize": (_c_handle,),
    "cuStreamWaitEvent": (_c_handle, _c_handle, ctypes.c_uint),
}


# Calls that wait for the device (or may take long) release the GIL; the others return in a
# microsecond or two and keep it (ctypes.PyDLL): releasing and taking the GIL back around each
# of them is where a batch thread queued behind the threads holding it (the folder runner's
# readers and writer), up to the interpreter's switch interval per call.
_RELEASE_GIL = {"cuInit", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuStreamSynchronize",
                "cuEventSynchronize"}


class CudaDriver:
    """``libcuda`` with the few functions used here typed once (``argtypes``/``restype``)."""

    def __init__(self, path: str = LIBCUDA) -> None:
        try:
            libs = {True: ctypes.CDLL(path), False: ctypes.PyDLL(path)}
        except OSError as exc:
            raise DeviceError(f"cannot load the CUDA driver library {path}: {exc}") from exc
        for name, argtypes in _SIGNATURES.items():
            try:
                fn = getattr(libs[name in _RELEASE_GIL], name)
            except AttributeError as exc:
                raise DeviceError(f"the CUDA driver {path} has no {name} (driver too old?)") from exc
            fn.argtypes = argtypes
            fn.restype = _c_result
            setattr(self, name, fn)
        self.path = path
        self.check(self.cuInit(0), "cuInit")

    def error_name(self, result: int) -> str:
        name = ctypes.c_char_p()
        if self.cuGetErrorName(result, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUresult {result}"
        return name.value.decode()

    def check(self, result: int, what: str) -> None:
        if result != CUDA_SUCCESS:
            raise DeviceError(f"{what} failed: {self.error_name(result)} ({result})")

    def primary_context(self, device: int) -> int:
        """Retain the device's primary context (the one torch and Numba use); release it with
        :meth:`release_primary_context`."""
        dev = ctypes.c_int()
        self.check(self.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        ctx = _c_handle()
        self.check(self.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
        if not ctx.value:
            raise DeviceError("cuDevicePrimaryCtxRetain returned no context")
        return int(ctx.value)

    def release_primary_context(self, device: int) -> None:
        dev = ctypes.c_int()
        self.check(self.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.check(self.cuDevicePrimaryCtxRelease_v2(dev.value), "cuDevicePrimaryCtxRelease")


_driver: CudaDriver | None = None
_driver_lock = threading.Lock()


def cuda_driver() -> CudaDriver:
    """The process's one :class:`CudaDriver` (loaded on first use); ``DeviceError`` if unusable."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = CudaDriver()
        return _driver


class RawDispatch:
    """One batch slot's hot path, in driver calls with every handle prepared beforehand:

    ``upload``: H2D of ``[0, nbytes)`` of the slot's pinned staging on the copy stream, then
    record ``uploaded`` (or, with nothing else in flight, straight on the compute stream);
    ``wait_inputs``: the compute stream waits for ``uploaded`` and for the decoder's event when
    the batch holds GPU-decoded JPEGs; ``launch`` the bucket's graph there; ``record_done``;
    ``wait``: block (without the GIL) until ``done``.

    The calling thread's current context is set first (a thread the pipeline has never seen
    has none, and the driver API needs one); ``cuCtxSetCurrent`` of the context already
    current is a cheap no-op.
    """

    def __init__(
        self, driver: CudaDriver, context: int, *, copy_stream: int, compute_stream: int, dst: int, src: int,
        uploaded: int, done: int,
    ) -> None:
        self._driver = driver
        self._context = _c_handle(context)
        self._copy = _c_handle(copy_stream)
        self._compute = _c_handle(compute_stream)
        self._dst = int(dst)
        self._src = _c_handle(src)
        self._uploaded = _c_handle(uploaded)
        self._done = _c_handle(done)
        self._set_current = driver.cuCtxSetCurrent
        self._memcpy = driver.cuMemcpyHtoDAsync_v2
        self._record = driver.cuEventRecord
        self._wait_event = driver.cuStreamWaitEvent
        self._launch = driver.cuGraphLaunch
        self._sync_event = driver.cuEventSynchronize

    def _check(self, r: int, what: str) -> None:
        if r:
            self._driver.check(r, what)

    def make_current(self) -> None:
        self._check(self._set_current(self._context), "cuCtxSetCurrent")

    def upload(self, nbytes: int, *, on_compute: bool = False) -> None:
        """H2D of the staging's first ``nbytes``: on the copy stream (then ``uploaded`` is
        recorded), or straight on the compute stream when nothing else is in flight."""
        if on_compute:
            self._check(self._memcpy(self._dst, self._src, nbytes, self._compute), "cuMemcpyHtoDAsync")
            return
        self._check(self._memcpy(self._dst, self._src, nbytes, self._copy), "cuMemcpyHtoDAsync")
        self._check(self._record(self._uploaded, self._copy), "cuEventRecord")

    def wait_inputs(self, uploaded: bool, decoded: int | None = None) -> None:
        """The compute stream waits for the copy stream's upload and/or the decoder's copies."""
        if uploaded:
            self._check(self._wait_event(self._compute, self._uploaded, 0), "cuStreamWaitEvent")
        if decoded is not None:
            self._check(self._wait_event(self._compute, decoded, 0), "cuStreamWaitEvent")

    def launch(self, graph_exec) -> None:
        self._check(self._launch(graph_exec, self._compute), "cuGraphLaunch")

    def record_done(self) -> None:
        self._check(self._record(self._done, self._compute), "cuEventRecord")

    def wait(self) -> None:
        self._check(self._sync_event(self._done), "cuEventSynchronize")


def copy_device_to_device(driver: CudaDriver, copies: list[tuple[int, int, int]], stream: int) -> None:
    """``(dst, src, nbytes)`` device copies enqueued on ``stream`` (one driver call each)."""
    memcpy, handle = driver.cuMemcpyDtoDAsync_v2, _c_handle(stream)
    for dst, src, nbytes in copies:
        r = memcpy(dst, src, nbytes, handle)
        if r:
            driver.check(r, "cuMemcpyDtoDAsync")


def copy_host_to_device(driver: CudaDriver, copies: list[tuple[int, int, int]], stream: int) -> None:
    """``(dst, pinned src, nbytes)`` host-to-device copies enqueued on ``stream``."""
    memcpy, handle = driver.cuMemcpyHtoDAsync_v2, _c_handle(stream)
    for dst, src, nbytes in copies:
        r = memcpy(dst, _c_handle(src), nbytes, handle)
        if r:
            driver.check(r, "cuMemcpyHtoDAsync")
