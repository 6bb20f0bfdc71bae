"""``app.gpu.early_decoder`` on a stand-in nvImageCodec (no CUDA): the decoders made on their own
thread have decoded one real JPEG when they are taken, are taken once, by the arguments they
were made for; the default chain is made on its first need where a hardware decoder exists (once,
and a chain that cannot start is None, said once); a failed start leaves the taker to make its own
(whose error says what is wrong); ``release`` drops what nobody took; the start holds the CUDA
context before nvImageCodec makes a decoder (none where nvImageCodec is missing) and lets go after;
and the runtime starts them only where nvImageCodec may decode."""

from __future__ import annotations

import importlib.machinery
import sys
import threading
import types

import numpy as np
import pytest

from app.errors import BackendUnavailable
from app.gpu import early_decoder
from app.imaging.decode import decode_image


class FakeNvImageCodec(types.ModuleType):
    """The parts of ``nvidia.nvimgcodec`` the early start uses; decoders made with
    ``fail=True`` raise, as nvImageCodec does without a GPU. ``gate`` holds every decoder's
    creation until it is set (a start still at work)."""

    def __init__(self, *, fail: bool = False, hardware: bool = True, chain_fails: bool = False) -> None:
        super().__init__("nvidia.nvimgcodec")
        self.__spec__ = importlib.machinery.ModuleSpec("nvidia.nvimgcodec", None)  # found, as an installed one
        self.fail, self.hardware, self.made, self.gate = fail, hardware, [], threading.Event()
        self.chain_fails = chain_fails
        self.gate.set()
        module = self

        class Decoder:
            def __init__(self, device_id=0, backends=None, max_num_cpu_threads=None, options=""):
                module.gate.wait()
                if module.fail or (backends and not module.hardware) or (not backends and module.chain_fails):
                    raise RuntimeError("no device")
                self.kind = "hardware" if backends else "chain"
                self.device, self.threads, self.options, self.decoded = device_id, max_num_cpu_threads, options, []
                module.made.append(self)

            def decode(self, streams, params=None, cuda_stream=0):
                self.decoded += [decode_image(s.data) for s in streams]
                return [types.SimpleNamespace(cpu=lambda: None) for _ in streams]

        self.Decoder = Decoder
        self.CodeStream = lambda data: types.SimpleNamespace(data=data)
        self.DecodeParams = lambda **kw: kw
        self.ColorSpec = types.SimpleNamespace(SRGB="srgb")
        self.Backend = lambda kind: kind
        self.BackendKind = types.SimpleNamespace(HW_GPU_ONLY="hw")


@pytest.fixture
def fake_nv(monkeypatch):
    def install(**kw) -> FakeNvImageCodec:
        fake = FakeNvImageCodec(**kw)
        try:
            import nvidia  # noqa: F401 - the namespace package of NVIDIA's wheels, where installed
        except ImportError:
            monkeypatch.setitem(sys.modules, "nvidia", types.ModuleType("nvidia"))
        monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
        monkeypatch.setattr(sys.modules["nvidia"], "nvimgcodec", fake, raising=False)
        return fake

    early_decoder.release()
    yield install
    early_decoder.release()


def test_the_decoders_started_early_have_decoded_a_jpeg_and_are_taken_once(fake_nv):
    fake = fake_nv()
    early_decoder.start(0, 8)
    early_decoder.start(0, 8)  # once per arguments
    taken = early_decoder.take(0, 8)
    assert taken is not None and taken.nv is fake
    assert [d.kind for d in fake.made] == ["hardware"] and taken.hardware is fake.made[0]  # no chain yet
    (pixels,) = fake.made[0].decoded  # one real JPEG, OpenCV reads it back as 64x64 colour
    assert pixels.shape == (64, 64, 3) and pixels.dtype == np.uint8 and pixels.std() > 10
    chain = taken.chain()  # its first need
    assert [d.kind for d in fake.made] == ["hardware", "chain"] and chain is fake.made[1] and taken.chain() is chain
    for decoder in fake.made:
        assert decoder.threads in (None, early_decoder.decoder_threads(8))
        assert decoder.options == early_decoder.NVIMGCODEC_OPTIONS
    assert early_decoder.take(0, 8) is None  # one owner


def test_take_waits_for_a_start_still_at_work(fake_nv):
    fake = fake_nv()
    fake.gate.clear()
    early_decoder.start(0, 8)
    got: list = []
    taker = threading.Thread(target=lambda: got.append(early_decoder.take(0, 8)))
    taker.start()
    taker.join(0.3)
    assert taker.is_alive() and not got  # waiting for the decoders, not making its own
    fake.gate.set()
    taker.join(10)
    assert got and got[0] is not None and got[0].hardware is fake.made[0]


def test_decoders_are_taken_only_by_the_arguments_they_were_made_for(fake_nv):
    fake_nv()
    early_decoder.start(0, 8)
    assert early_decoder.take(1, 8) is None  # another device
    assert early_decoder.take(0, 8, ":other") is None  # other options
    assert early_decoder.take(0, 8) is not None


def test_a_failed_start_leaves_the_taker_to_make_its_own_which_says_why(fake_nv):
    fake_nv(fail=True)
    early_decoder.start(0, 8)
    assert early_decoder.take(0, 8) is None
    with pytest.raises(BackendUnavailable, match="could not start a decoder"):
        early_decoder.make(0, 8)


def test_no_hardware_decoder_leaves_the_chain_alone(fake_nv):
    fake = fake_nv(hardware=False)
    early_decoder.start(0, 8)
    taken = early_decoder.take(0, 8)
    assert taken is not None and taken.hardware is None and [d.kind for d in fake.made] == ["chain"]
    assert taken.chain() is fake.made[0] and len(fake.made[0].decoded) == 1  # made at start: it decodes everything


def test_a_chain_that_cannot_start_on_its_first_need_is_none_and_said_once(fake_nv, caplog):
    fake = fake_nv(chain_fails=True)
    early_decoder.start(0, 8)
    taken = early_decoder.take(0, 8)
    assert taken is not None and taken.hardware is fake.made[0]  # the hardware decoder starts as ever
    with caplog.at_level("WARNING", logger="app.gpu.early_decoder"):
        assert taken.chain() is None and taken.chain() is None
    assert [r.getMessage() for r in caplog.records].count(
        "nvImageCodec's default decoder chain could not start (RuntimeError: no device): OpenCV decodes what the "
        "hardware JPEG decoder does not take") == 1
    assert [d.kind for d in fake.made] == ["hardware"]


def test_release_drops_what_nobody_took(fake_nv):
    fake_nv()
    early_decoder.start(0, 8)
    early_decoder.release()
    assert early_decoder.take(0, 8) is None


@pytest.mark.parametrize("fail", [False, True])
def test_the_cuda_context_is_held_before_nvimgcodec_makes_a_decoder_and_let_go_after(fake_nv, monkeypatch, fail):
    """The start makes the CUDA context itself (through ctypes, the GIL free) before nvImageCodec
    makes its decoders, which would make it holding the GIL, and lets go of its hold once they
    have decoded (they hold the context themselves), or once they failed."""
    fake = fake_nv(fail=fail)
    seen: list[tuple[str, int, int]] = []

    def retain(device: int):
        seen.append(("retain", device, len(fake.made)))
        return lambda: seen.append(("release", device, sum(len(d.decoded) for d in fake.made)))

    monkeypatch.setattr(early_decoder, "retain_primary_context", retain)
    early_decoder.start(1, 8)
    taken = early_decoder.take(1, 8)
    assert (taken is None) == fail
    assert seen == [("retain", 1, 0), ("release", 1, 0 if fail else 1)]  # no decoder yet; then one JPEG decoded


def test_the_start_makes_no_cuda_context_where_nvimgcodec_is_missing(monkeypatch):
    retained: list[int] = []
    monkeypatch.setattr(early_decoder, "_nvimgcodec_installed", lambda: False)
    monkeypatch.setattr(early_decoder, "retain_primary_context", lambda device: retained.append(device))
    monkeypatch.setattr(early_decoder, "make", lambda *a: (_ for _ in ()).throw(BackendUnavailable("not installed")))
    early_decoder.release()
    early_decoder.start(0, 8)
    assert early_decoder.take(0, 8) is None  # waits for the start's end
    early_decoder.release()
    assert retained == []


@pytest.mark.parametrize(("backend", "decode", "started"), [
    ("auto", "gpu", True), ("torch-cuda", "nvimgcodec", True), ("auto", "opencv", False),
    ("auto", "cpu", False), ("auto", "nvjpeg", False), ("onnxruntime", "gpu", False),
])
def test_the_runtime_starts_them_only_where_nvimgcodec_may_decode(monkeypatch, backend, decode, started):
    from app.contracts import RunShape
    from app.runtime import OpenOptions, start_decoder_early

    calls = []
    monkeypatch.setattr(early_decoder, "start", lambda device, threads: calls.append((device, threads)))
    start_decoder_early(OpenOptions(backend=backend, device=0, shape=RunShape(decode=decode)))
    from app.config import gpu_host_threads

    assert calls == ([(0, gpu_host_threads())] if started else [])
