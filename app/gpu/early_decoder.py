"""nvImageCodec's decoders started early: imported, made and through their first decode on a
thread of their own while the process imports torch and loads the engine, then handed to the
GPU pipeline that asks for the same ones (``NvImageCodecDecoder``).

Why: nvImageCodec's import, its decoders' creation and its hardware decoder's first decode are
a second or more of native start-up that used to run after ``import torch`` and the engine's
load, on the way to ``predict``'s first result and ``serve``'s readiness. Beside them, part of
it still holds the GIL and slows the main thread's steps meanwhile, but less than it cost in
line (``bench/results/2026-12-06-nvidia-h100-issue45-README.md``). The largest part was the
CUDA context, which nvImageCodec's import made holding the GIL: the thread now makes it first,
through ctypes with the GIL free (``app.gpu.probe.retain_primary_context``).

``start`` (``app.runtime.ensure_artifacts``, before anything imports torch) starts the thread;
``take`` hands what it made to its one owner, the pipeline's decoder (waiting for the thread if
it is still at work), or None if it failed: the decoder then makes its own, and that one says
what is wrong. ``release`` drops what nobody took (``app.runtime.open_model_dir`` once the
detector is open, also when opening failed). ``make`` is the one recipe both paths use.

Where a hardware JPEG decoder exists it takes nearly every photo, so nvImageCodec's default chain
(its fallback for progressive and 4:1:1 JPEGs and for what the hardware refuses) is made on its
first need (``NvDecoders.chain``), not at start: a folder of baseline JPEGs never makes it, nor
waits for it to go away (about 0.16 s of a pipeline's ``close`` on an H100, where the hardware
decoder's own going takes 0.36 s after a folder: ``bench/results/2026-12-06-nvidia-h100-decoders-going-probe.json``).

Nothing heavy is imported here at module level: ``app.runtime`` imports this before torch.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from app.errors import BackendUnavailable
from app.gpu.probe import retain_primary_context

log = logging.getLogger(__name__)

# libjpeg-turbo (OpenCV, Ultralytics) interpolates subsampled chroma ("fancy upsampling");
# nvImageCodec's CUDA decoder does the same when told.
NVIMGCODEC_OPTIONS = ":fancy_upsampling=1"

_lock = threading.Lock()
_quiet_lock = threading.Lock()  # the early thread and a pipeline may both set nvImageCodec up
_started: dict[tuple[int, int, str], Future] = {}


class NvDecoders:
    """What a pipeline's nvImageCodec decoder runs on: the module, its decode parameters, the
    hardware JPEG decoder (None where there is none) and the default chain (CUDA, hybrid):
    ``chain()``, made by ``make_chain`` on its first need unless given made (``chain``)."""

    def __init__(self, nv: Any, params: Any, hardware: Any, make_chain: Callable[[], Any], chain: Any = None) -> None:
        self.nv, self.params, self.hardware = nv, params, hardware
        self._make_chain, self._chain, self._chain_failed = make_chain, chain, False
        self._lock = threading.Lock()  # batches on several threads may need it first at once

    def chain(self) -> Any:
        """The default chain, made now if this is its first need; None if it cannot start: what
        it would have decoded goes to OpenCV (said once, in the log)."""
        with self._lock:
            if self._chain is None and not self._chain_failed:
                try:
                    self._chain = self._make_chain()
                except Exception as exc:  # noqa: BLE001 - the hardware decoder and OpenCV go on
                    self._chain_failed = True
                    log.warning("nvImageCodec's default decoder chain could not start (%s: %s): OpenCV decodes what "
                                "the hardware JPEG decoder does not take", type(exc).__name__, exc)
            return self._chain

    def made(self) -> list[Any]:
        """The decoders made so far."""
        return [d for d in (self.hardware, self._chain) if d is not None]


def decoder_threads(asked: int) -> int:
    """nvImageCodec's CPU threads for ``asked``: it warns when asked for as many threads as there
    are cores, so one fewer at most."""
    return max(1, min(int(asked), (os.cpu_count() or 2) - 1))


def make(device: int, threads: int, options: str = NVIMGCODEC_OPTIONS) -> NvDecoders:
    """nvImageCodec's decoders on ``device``; ``BackendUnavailable`` where it is not installed or
    cannot start one (no GPU, no nvJPEG library)."""
    quiet_nvimgcodec()
    try:
        from nvidia import nvimgcodec as nv
    except ImportError as exc:
        raise BackendUnavailable("nvImageCodec is not installed",
                                 hint="pip install 'yolopipe[cuda13]' (or [cuda12])") from exc
    def make_chain() -> Any:
        return nv.Decoder(device_id=device, max_num_cpu_threads=decoder_threads(threads), options=options)

    try:
        params = decode_params(nv)
        hardware = _hardware_decoder(nv, device, options)
        chain = make_chain() if hardware is None else None  # the chain decodes everything: made now
    except Exception as exc:  # e.g. no nvJPEG library: the caller falls back
        raise BackendUnavailable(f"nvImageCodec could not start a decoder: {type(exc).__name__}: {exc}") from exc
    return NvDecoders(nv, params, hardware, make_chain, chain)


def decode_params(nv: Any) -> Any:
    """What every decode asks of nvImageCodec: EXIF orientation applied, sRGB, 8 bits."""
    return nv.DecodeParams(apply_exif_orientation=True, color_spec=nv.ColorSpec.SRGB, allow_any_depth=False)


def _hardware_decoder(nv: Any, device: int, options: str) -> Any:
    """The hardware JPEG decoder alone, or None where there is none (the chain does it all).

    Measured on the H200 (bench ``decoders`` rows): alone it decodes baseline JPEGs at 11,800
    img/s with libjpeg-turbo's pixels (one value in 75,000 off by one level) and no CPU or SM
    time, while the default chain (which hands part of a batch to its CUDA and hybrid decoders)
    did 7,400 img/s and competed with the engine for the SMs and with the host for the CPU. So
    it gets every image first (``app.gpu.nvimgcodec``).
    """
    try:
        return nv.Decoder(device_id=device, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)], options=options)
    except Exception as exc:  # noqa: BLE001 - no hardware decoder here
        log.info("nvImageCodec: no hardware JPEG decoder (%s)", exc)
        return None


def start(device: int, threads: int, options: str = NVIMGCODEC_OPTIONS) -> None:
    """Make the decoders of ``(device, threads, options)`` and run their first decode on a
    thread of its own, unless that has started already. Call it before the process makes its
    first CUDA context (``app.gpu.device.configure_process`` first: this thread may make it)."""
    key = (int(device), decoder_threads(threads), options)
    with _lock:
        if key in _started:
            return
        future: Future = Future()
        _started[key] = future
    threading.Thread(target=_start, args=(future, *key), name="yolopipe-decoder-start", daemon=True).start()


def _start(future: Future, device: int, threads: int, options: str) -> None:
    # The CUDA context first, with the GIL free: nvImageCodec's import would make it holding the
    # GIL, and the main thread's start-up (the export check, import torch) would wait meanwhile.
    release_context = retain_primary_context(device) if _nvimgcodec_installed() else None
    try:
        decoders = make(device, threads, options)
        _first_decode(decoders)
    except BaseException as exc:  # noqa: BLE001 - handed to whoever takes it; it then makes its own
        future.set_exception(exc)
    else:
        future.set_result(decoders)
    finally:
        if release_context is not None:
            release_context()  # the decoders made hold the context themselves


def _nvimgcodec_installed() -> bool:
    """Whether nvImageCodec can be imported (found, not imported: none of it runs)."""
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except ModuleNotFoundError:  # not even the namespace package of NVIDIA's wheels
        return False


def _first_decode(decoders: NvDecoders) -> None:
    """One small baseline JPEG through each decoder made (the hardware decoder; the chain where
    there is none), waited for: their one-time set-up happens here rather than in the first
    batch."""
    import cv2
    import numpy as np

    y, x = np.mgrid[0:64, 0:64]
    ok, encoded = cv2.imencode(".jpg", np.dstack([x * 4, y * 4, x + y]).astype(np.uint8))
    if not ok:
        return
    data = encoded.tobytes()
    for decoder in decoders.made():
        for image in decoder.decode([decoders.nv.CodeStream(data)], params=decoders.params):
            wait = getattr(image, "cpu", None)  # a copy to the host waits for the decode
            if wait is not None:
                wait()


def take(device: int, threads: int, options: str = NVIMGCODEC_OPTIONS) -> NvDecoders | None:
    """The decoders ``start`` made for these arguments, now owned by the caller (waiting for the
    thread if it is still at work); None if none were started or their start failed."""
    with _lock:
        future = _started.pop((int(device), decoder_threads(threads), options), None)
    if future is None:
        return None
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - the caller makes its own, and that one says what is wrong
        log.info("nvImageCodec's early start failed (%s: %s)", type(exc).__name__, exc)
        return None


def release() -> None:
    """Drop what ``start`` made and nobody took (a thread still at work drops it when done)."""
    with _lock:
        _started.clear()


def quiet_nvimgcodec() -> None:
    """Before nvImageCodec is first imported: load only the extensions whose libraries are here
    (the JPEG 2000 and TIFF ones log errors at import when nvjpeg2k / nvtiff are absent), and
    keep its Python layer's per-image warnings off the terminal. A user's own settings win."""
    with _quiet_lock:
        _quiet()


def _quiet() -> None:
    import importlib.util

    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "1")
    if "NVIMGCODEC_EXTENSIONS_PATH" in os.environ:
        return
    try:
        spec = importlib.util.find_spec("nvidia.nvimgcodec")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    from pathlib import Path

    ext = Path(next(iter(spec.submodule_search_locations))) / "extensions"
    if not ext.is_dir():
        return
    missing = [name for name, module in (("nvjpeg2k", "nvidia.nvjpeg2k"), ("nvtiff", "nvidia.nvtiff"))
               if _absent(module)]
    if not missing:
        return
    import atexit
    import shutil
    import tempfile

    keep = tempfile.mkdtemp(prefix="yolopipe-nvimgcodec-ext-")
    atexit.register(shutil.rmtree, keep, True)
    for f in ext.iterdir():
        if not any(m in f.name for m in missing):
            os.symlink(f, os.path.join(keep, f.name))
    os.environ["NVIMGCODEC_EXTENSIONS_PATH"] = keep


def _absent(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True
