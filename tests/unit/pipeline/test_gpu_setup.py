"""``GpuPipeline``'s set-up, with its device parts stood in for (no GPU here): it reads the run
shape it is given, a step that fails frees what the steps before it took, the engine left to its
caller, and the device is current only inside the set-up, never left so on the caller's thread."""

from __future__ import annotations

import contextlib
import types

import pytest

from app.contracts import RunShape
from app.errors import DeviceError, InvalidParameter
from app.gpu.device import CudaDevice

pytest.importorskip("torch")


class Part:
    """A stand-in for one device resource: records its release in ``freed``."""

    def __init__(self, name: str, freed: list[str]) -> None:
        self.name, self.freed = name, freed
        self.staging = types.SimpleNamespace(capacity=1)  # what a BatchSlot has

    def free(self) -> None:
        self.freed.append(self.name)

    close = free


@pytest.fixture
def freed(monkeypatch) -> list[str]:
    import torch

    import app.gpu.decode
    from app.pipeline import gpu

    freed: list[str] = []

    class FailingDispatcher(Part):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__("dispatcher", freed)

        def setup(self, slots) -> None:  # the last step
            raise DeviceError("no driver")

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("the caller's device changed"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(gpu, "StreamPair", lambda device: Part("compute", freed))
    monkeypatch.setattr(gpu, "InputBuffer", lambda *args: Part("inputs", freed))
    monkeypatch.setattr(gpu, "BatchSlot", lambda i, **kwargs: Part(f"slot {i}", freed))
    monkeypatch.setattr(gpu, "GraphBuilder", lambda *args, **kwargs: Part("graphs", freed))
    monkeypatch.setattr(app.gpu.decode, "make_decoder", lambda *args: Part("decoder", freed))  # Decoders calls it
    monkeypatch.setattr(gpu, "Dispatcher", FailingDispatcher)
    return freed


class StandInDevice(CudaDevice):
    """A ``CudaDevice`` whose ``current`` notes when it is entered and left (no CUDA here)."""

    def __init__(self, index: int, freed: list[str]) -> None:
        super().__init__(index)
        self.freed = freed

    @contextlib.contextmanager
    def current(self):
        self.freed.append("current: in")
        try:
            yield
        finally:
            self.freed.append("current: out")


def engine(freed: list[str]) -> types.SimpleNamespace:
    return types.SimpleNamespace(max_batch=4, name="torch-cuda", precision="fp16", input_dtype="float16",
                                 close=lambda: freed.append("engine"))


def test_a_step_that_fails_frees_every_step_before_it_and_leaves_the_engine(freed):
    from app.pipeline.gpu import GpuPipeline

    with pytest.raises(DeviceError, match="no driver"):
        GpuPipeline(engine(freed), types.SimpleNamespace(imgsz=640), RunShape(max_batch=4, in_flight=2),
                    StandInDevice(1, freed))
    # freed in reverse, with the device still current; the caller's own device is back after it
    assert freed == ["current: in", "dispatcher", "decoder", "graphs", "slot 1", "slot 0", "inputs", "compute",
                     "current: out"]


def test_a_shape_over_the_engine_is_refused_before_anything_is_taken(freed):
    from app.pipeline.gpu import GpuPipeline

    with pytest.raises(InvalidParameter, match="over the engine's max_batch 4"):
        GpuPipeline(engine(freed), types.SimpleNamespace(imgsz=640), RunShape(max_batch=8), StandInDevice(0, freed))
    assert freed == []
