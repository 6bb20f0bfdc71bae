"""NVDEC readers and graph captures on one device (``app.gpu.nvdec``, ``app.gpu.device``), on a CPU.

On the H200 every stream with the model failed at capture: NVDEC's decode threads made CUDA
calls while a graph was captured, and a call on the same device invalidates a capture in any
capture mode. Here PyNvVideoCodec and the reader's CUDA context are stood in for: the stand-in
decoder notes every call it gets while a capture holds the device's gate (as the driver would
invalidate that capture), and takes the time a decode takes (without the GIL). Readers decode on
four threads, each on the ``CudaDevice`` it is given, while the main thread captures on it over
and over, as a pipeline does: no decode call may land inside a capture.
``test_the_stand_in_sees_calls_inside_a_capture`` shows the stand-in catches one when a decode
call ignores the gate.
"""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from app.gpu import nvdec
from app.gpu.device import CudaDevice


class Device:
    """What the driver would see: captures in progress and calls made during one."""

    def __init__(self, cuda: CudaDevice) -> None:
        self.cuda = cuda
        self.calls = 0
        self.inside_capture: list[str] = []

    def call(self, what: str) -> None:
        self.calls += 1
        if self.cuda.held_exclusive:
            self.inside_capture.append(what)
        time.sleep(0.0005)  # the call's own time, GIL released: a capture may start meanwhile
        if self.cuda.held_exclusive:
            self.inside_capture.append(what)


def stand_in_codec(device: Device, frames_per_file: int, *, counted: bool = True) -> types.SimpleNamespace:
    """PyNvVideoCodec's file decoder, ``frames_per_file`` frames, which says how many (``counted``)
    as its stream metadata does, and notes each call's ask (``asked``)."""

    asked: list[int] = []

    class SimpleDecoder:
        def __init__(self, source, **kwargs) -> None:
            device.call("open")
            self.left = frames_per_file

        def get_stream_metadata(self):
            return types.SimpleNamespace(average_fps=30.0, height=48, width=64,
                                         num_frames=frames_per_file if counted else 0)

        def get_batch_frames(self, n):
            device.call("decode")
            asked.append(n)
            n = min(n, self.left)
            self.left -= n
            return [np.zeros((72, 64), np.uint8) for _ in range(n)]  # NV12 planes; DLPack-able as torch's are

        def __del__(self) -> None:
            device.call("close")

    return types.SimpleNamespace(SimpleDecoder=SimpleDecoder, ThreadedDecoder=SimpleDecoder, asked=asked,
                                 OutputColorType=types.SimpleNamespace(NATIVE=0))


class StandInCuda:
    def __init__(self, gpu_id: int) -> None:
        self.context, self.stream = 1, types.SimpleNamespace(cuda_stream=0)

    def release(self) -> None:
        pass


@pytest.fixture
def device(monkeypatch):
    pytest.importorskip("torch")  # torch.from_dlpack reads the frames
    dev = Device(CudaDevice(0))
    monkeypatch.setattr(nvdec, "_Cuda", StandInCuda)
    monkeypatch.setattr(nvdec, "_nvc", lambda: stand_in_codec(dev, 40))
    return dev


def captures_while_readers_decode(device: Device, reader, threads: int = 4, captures: int = 200) -> int:
    """``reader()`` on ``threads`` threads until the captures are done; how many frames they read."""
    stop, read, errors = threading.Event(), [0], []

    def loop() -> None:
        try:
            while not stop.is_set():
                read[0] += reader()
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    for _ in range(captures):
        with device.cuda.exclusive():  # what GpuPipeline's capture holds
            time.sleep(0.0005)
        time.sleep(0.0002)
    stop.set()
    for w in workers:
        w.join(10)
    assert not errors, errors
    return read[0]


def test_no_nvdec_call_lands_inside_a_capture(device):
    def read_a_file() -> int:
        reader = nvdec.NvdecReader("clip.mp4", device=device.cuda, batch=8)
        frames = sum(len(batch) for batch in reader.batches())
        reader.close()
        return frames

    frames = captures_while_readers_decode(device, read_a_file)
    assert frames > 0 and device.calls > 20
    assert device.inside_capture == []


def test_the_stand_in_sees_calls_inside_a_capture(device):
    """The same load with decode calls made past the gate: the stand-in catches them."""
    decoder = nvdec._nvc().SimpleDecoder("clip.mp4")

    def ungated() -> int:
        decoder.left = 8
        return len(decoder.get_batch_frames(8))

    captures_while_readers_decode(device, ungated)
    assert device.inside_capture


@pytest.mark.parametrize("counted", [True, False])
def test_a_file_is_never_asked_for_frames_past_its_end(monkeypatch, counted):
    """SimpleDecoder prints "[WARN ] INVALID INDEX n" for every frame asked for past a file's end
    (on the H200, four lines at the end of every stream of the clip): with the count its metadata
    gives, the last call asks for what is left and none follows; without one, it asks until a
    call gives nothing, as before."""
    pytest.importorskip("torch")
    cuda = CudaDevice(0)
    codec = stand_in_codec(Device(cuda), 20, counted=counted)
    monkeypatch.setattr(nvdec, "_Cuda", StandInCuda)
    monkeypatch.setattr(nvdec, "_nvc", lambda: codec)
    reader = nvdec.NvdecReader("clip.mp4", device=cuda, batch=8)
    assert sum(len(batch) for batch in reader.batches()) == 20
    reader.close()
    assert codec.asked == ([8, 8, 4] if counted else [8, 8, 8, 8])
