"""``app.gpu.probe``'s hold on the primary CUDA context, through a stand-in of the driver library
(the ctypes calls ``retain_primary_context`` makes, with their by-reference outputs): made on the
device asked for, let go by the call it returns, and None where a driver call fails or there is
no driver."""

from __future__ import annotations

import ctypes

import pytest

from app.gpu import probe


class FakeLibcuda:
    """The driver calls ``retain_primary_context`` makes; ``failing`` names one that returns an
    error (CUDA_ERROR_INVALID_DEVICE, 101). ``held`` counts the holds on each device's context."""

    def __init__(self, failing: str = "", v2: bool = True) -> None:
        self.failing, self.held, self.calls = failing, {}, []
        if v2:
            self.cuDevicePrimaryCtxRelease_v2 = lambda handle: self._release(handle, "cuDevicePrimaryCtxRelease_v2")

    def _result(self, name: str) -> int:
        self.calls.append(name)
        return 101 if name == self.failing else 0

    def cuInit(self, flags):
        return self._result("cuInit")

    def cuDeviceGet(self, out, ordinal):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int)).contents.value = 10 + ordinal  # a handle, not the ordinal
        return self._result("cuDeviceGet")

    def cuDevicePrimaryCtxRetain(self, out, handle):
        result = self._result("cuDevicePrimaryCtxRetain")
        if not result:
            self.held[handle.value] = self.held.get(handle.value, 0) + 1
        return result

    def _release(self, handle, name):
        self.held[handle.value] -= 1
        return self._result(name)

    def cuDevicePrimaryCtxRelease(self, handle):  # the unversioned name, of drivers before CUDA 11
        return self._release(handle, "cuDevicePrimaryCtxRelease")


@pytest.mark.parametrize("v2", [True, False])
def test_the_hold_is_on_the_device_asked_for_and_let_go_by_the_call_returned(monkeypatch, v2):
    cuda = FakeLibcuda(v2=v2)
    monkeypatch.setattr(probe, "libcuda", lambda: cuda)
    release = probe.retain_primary_context(1)
    assert release is not None and cuda.held == {11: 1}
    assert cuda.calls == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    release()
    assert cuda.held == {11: 0} and cuda.calls[-1] == ("cuDevicePrimaryCtxRelease_v2" if v2 else "cuDevicePrimaryCtxRelease")


@pytest.mark.parametrize("failing", ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"])
def test_a_failed_driver_call_holds_nothing(monkeypatch, failing):
    cuda = FakeLibcuda(failing=failing)
    monkeypatch.setattr(probe, "libcuda", lambda: cuda)
    assert probe.retain_primary_context(0) is None
    assert cuda.held == {} and cuda.calls[-1] == failing  # nothing called after the failure


def test_no_driver_no_hold(monkeypatch):
    monkeypatch.setattr(probe, "libcuda", lambda: None)
    assert probe.retain_primary_context(0) is None
