"""``NvImageCodecDecoder.decode_into`` on a stand-in nvImageCodec (no CUDA): an image counts as
decoded in place only when nvImageCodec returned it, at its target, at its size; a None in the
results (nvImageCodec 0.6+'s per-image failure), a shorter list (older ones drop failed
images), an exception or an image elsewhere each send that image alone to the next decoder,
then to OpenCV."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from app.gpu.decoded import IN_PLACE
from app.imaging.check import check_image
from app.imaging.decode import decode_image


class Memory:
    """Device memory as host bytes; pointers are offsets."""

    def __init__(self, n: int) -> None:
        self.bytes = np.zeros(n, np.uint8)


class Image:
    def __init__(self, cai: dict) -> None:
        self.__cuda_array_interface__ = cai


class Stream:
    def __init__(self, data: bytes) -> None:
        if data.startswith(b"unparseable"):
            raise RuntimeError("cannot parse")
        self.data = data


class Decoder:
    """``behaviour[data]`` for this decoder: ``ok`` (default), ``none`` (a None in the results),
    ``dropped`` (left out of the results), ``elsewhere`` (an image at another address),
    ``raises`` (the whole call raises)."""

    def __init__(self, memory: Memory, behaviour: dict[bytes, str]) -> None:
        self.memory, self.behaviour, self.calls = memory, behaviour, []

    def decode(self, streams, images=None, params=None, cuda_stream=0):
        self.calls.append([s.data for s in streams])
        out = []
        for stream, image in zip(streams, images):
            how = self.behaviour.get(stream.data, "ok")
            if how == "raises":
                raise RuntimeError("nvImageCodec failed the batch")
            if how == "dropped":
                continue
            if how == "none":
                out.append(None)
                continue
            cai = image.__cuda_array_interface__
            ptr = cai["data"][0]
            rgb = np.ascontiguousarray(decode_image(stream.data)[..., ::-1]).reshape(-1)
            self.memory.bytes[ptr : ptr + rgb.size] = rgb
            if how == "elsewhere":
                out.append(Image({**cai, "data": (ptr + 1, False)}))
            else:
                out.append(image)
        return out


@pytest.fixture
def decoder():
    from app.gpu.nvimgcodec import NvImageCodecDecoder

    memory = Memory(64 << 20)
    d = object.__new__(NvImageCodecDecoder)
    d.stream = types.SimpleNamespace(cuda_stream=0)
    d.lock = threading.Lock()
    d._params, d._into = None, True
    d._nv = types.SimpleNamespace(CodeStream=Stream,
                                  as_images=lambda views, cuda_stream=0: [Image(v.__cuda_array_interface__) for v in views])
    d._hw, d.chain_standin = Decoder(memory, {}), Decoder(memory, {})
    d.chain_needs = 0

    def chain():  # NvDecoders.chain: the default chain, counted each time a batch needs it
        d.chain_needs += 1
        return d.chain_standin

    d._decoders = types.SimpleNamespace(chain=chain)
    d.memory = memory
    return d


@pytest.fixture(scope="module")
def jpegs(assets_dir):
    import cv2

    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    return [(assets_dir / "bus.jpg").read_bytes(), (assets_dir / "zidane.jpg").read_bytes(),
            cv2.imencode(".jpg", bus[:, ::-1])[1].tobytes(), cv2.imencode(".jpg", cv2.resize(bus, (64, 80)))[1].tobytes()]


def run(decoder, datas):
    headers = [check_image(d).jpeg for d in datas]
    targets, offset = [], 0
    for h in headers:
        targets.append(offset)
        offset += h.height * h.width * 3 + 256
    return decoder.decode_into(datas, headers, targets), targets


def pixels_at(decoder, target, data):
    h, w = check_image(data).height, check_image(data).width
    return decoder.memory.bytes[target : target + h * w * 3].reshape(h, w, 3)[..., ::-1]


@pytest.mark.parametrize("how", ["none", "dropped", "elsewhere", "raises"])
def test_an_image_the_hardware_decoder_does_not_return_in_place_goes_to_the_chain(decoder, jpegs, how):
    decoder._hw.behaviour = {jpegs[1]: how}
    answers, targets = run(decoder, jpegs)
    assert answers == [IN_PLACE] * 4
    assert decoder.chain_standin.calls == [[jpegs[1]]]  # that image alone, not its batch
    for data, target in zip(jpegs, targets):
        np.testing.assert_array_equal(pixels_at(decoder, target, data), decode_image(data))


@pytest.mark.parametrize("how", ["none", "dropped", "elsewhere", "raises"])
def test_an_image_neither_decoder_returns_in_place_is_opencvs_frame(decoder, jpegs, how):
    decoder._hw.behaviour = decoder.chain_standin.behaviour = {jpegs[2]: how}
    answers, _ = run(decoder, jpegs)
    assert [a is IN_PLACE for a in answers] == [True, True, False, True]
    np.testing.assert_array_equal(answers[2], decode_image(jpegs[2]))


def test_a_batch_the_hardware_decoder_takes_whole_never_asks_for_the_chain(decoder, jpegs):
    answers, _ = run(decoder, jpegs)
    assert answers == [IN_PLACE] * 4 and decoder._hw.calls == [jpegs] and decoder.chain_needs == 0


def test_a_progressive_jpeg_goes_to_the_chain_alone(decoder, jpegs, assets_dir):
    import cv2

    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    progressive = cv2.imencode(".jpg", bus, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
    answers, _ = run(decoder, [jpegs[0], progressive])
    assert answers == [IN_PLACE] * 2 and decoder._hw.calls == [[jpegs[0]]]
    assert decoder.chain_standin.calls == [[progressive]] and decoder.chain_needs == 1


def test_an_unparseable_stream_is_opencvs_answer_and_no_decoder_is_handed_it(decoder, jpegs, monkeypatch):
    import app.gpu.nvimgcodec

    bad = b"unparseable" + jpegs[0]
    sentinel = object()
    monkeypatch.setattr(app.gpu.nvimgcodec, "cpu_decode", lambda data: sentinel if data == bad else None)
    headers = [check_image(jpegs[0]).jpeg, check_image(jpegs[1]).jpeg]
    answers = decoder.decode_into([bad, jpegs[1]], headers, [0, 10 << 20])
    assert answers == [sentinel, IN_PLACE]
    assert all(bad not in call for call in decoder._hw.calls + decoder.chain_standin.calls)
