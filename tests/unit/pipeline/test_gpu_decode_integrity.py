"""The GPU pipeline's batch path (``GpuPipeline._run``: routing, planning, the decode into the
slot's staging, settling, the params header) driven for real without CUDA: the slot's device
staging is host memory, the decoder a stand-in that writes OpenCV's pixels where the pipeline
says (whole, half, or not at all, and reports what it is told to), and the graph a stand-in
that returns, for each batch position the params header names, the pixels it reads there.

So each image's "detections" are the pixels the graph read for it: an image gets its own
pixels or its error, never another image's, whatever the decoder does."""

from __future__ import annotations

import contextlib
import threading
import types

import cv2
import numpy as np
import pytest

from app.config import MAX_PIXELS
from app.contracts import DetectParams, EncodedImage, PipelineRun
from app.errors import InvalidImage
from app.gpu.decode import Decoders
from app.gpu.decoded import IN_PLACE, GpuJpegDecoder, cpu_decode
from app.gpu.memory import align_up
from app.gpu.pack import bucket_sizes
from app.gpu.preprocess import (
    LAYOUT_HWC_BGR,
    LAYOUT_HWC_RGB,
    P_LAYOUT,
    P_NEW_H,
    P_OFFSET,
    P_SRC_H,
    P_SRC_W,
    PARAMS_PER_IMAGE,
)
from app.imaging.check import check_image
from app.imaging.decode import decode_image
from app.imaging.headers import read_header

MAX_BATCH = 8


class _Span:
    def __init__(self, mem: np.ndarray, where: slice) -> None:
        self.mem, self.where = mem, where

    def zero_(self) -> None:
        self.mem[self.where] = 0


class _Pointer:
    """A buffer's address: offsets into the stand-in memory start at 0."""

    def data_ptr(self) -> int:
        return 0


class DeviceMemory(_Pointer):
    """The slot's device staging, as host memory; starts as junk."""

    def __init__(self, n: int) -> None:
        self.mem = np.full(n, 0xAB, np.uint8)

    def __getitem__(self, where: slice) -> _Span:
        return _Span(self.mem, where)


class Slot:
    def __init__(self, capacity: int = 16 << 20) -> None:
        self.index = 0
        self.staging = types.SimpleNamespace(header_bytes=align_up(MAX_BATCH * PARAMS_PER_IMAGE * 8), capacity=capacity)
        total = self.staging.header_bytes + capacity
        self.staging.dev = DeviceMemory(total)
        self.staging.host = _Pointer()
        self.staging.host_np = np.zeros(total, np.uint8)
        self.staging.host_params = self.staging.host_np[: self.staging.header_bytes].view(np.int64)[
            : MAX_BATCH * PARAMS_PER_IMAGE].reshape(MAX_BATCH, -1)
        self.decoded = types.SimpleNamespace(record=lambda stream: None)


class StandInDecoder(GpuJpegDecoder):
    """Decodes with OpenCV and writes RGB where the pipeline says. ``behaviour[data]``:
    ``whole`` (default), ``half_fails`` (writes the top half, reports a failure: the real
    decoders then hand the image to OpenCV), ``half_lies`` (writes the top half, reports
    success), ``error`` (writes junk there, answers an error)."""

    name = "stand-in"
    layout = LAYOUT_HWC_RGB

    def __init__(self, memory, behaviour=None) -> None:  # no CUDA: a stream of nothing, no driver
        self.stream = types.SimpleNamespace(cuda_stream=0)
        self.lock = threading.Lock()
        self.memory = memory  # () -> the slot's device memory
        self.behaviour = behaviour or {}
        self.handed: list[bytes] = []
        self.places: dict[bytes, tuple[int, int]] = {}  # where each image was to be decoded

    def decode_into(self, datas, headers, targets):
        mem = self.memory()
        out = []
        for data, header, ptr in zip(datas, headers, targets):
            self.handed.append(data)
            rgb = np.ascontiguousarray(opencv(data)[..., ::-1]).reshape(-1)
            self.places[data] = (ptr, ptr + rgb.size)
            assert rgb.size == header.height * header.width * 3  # the place reserved from the header
            how = self.behaviour.get(data, "whole")
            if how == "whole":
                mem[ptr : ptr + rgb.size] = rgb
                out.append(IN_PLACE)
            elif how in ("half_fails", "half_lies"):
                mem[ptr : ptr + rgb.size // 2] = rgb[: rgb.size // 2]
                out.append(IN_PLACE if how == "half_lies" else cpu_decode(data))
            else:
                mem[ptr : ptr + rgb.size] = 77
                out.append(InvalidImage("the stand-in decoder failed"))
        return out


class Graph:
    """The batch's graph, as far as pixels go: the one H2D copy of ``[0, host_end)``, then for
    every batch position the params header names, the pixels at its offset (as BGR)."""

    def __init__(self) -> None:
        self.launches = 0
        self.reads: list[tuple[int, int]] = []

    def __call__(self, slot, placed, host_end, bucket, waits_decoder, params, profile, *, results, **_):
        self.launches += 1
        mem = slot.staging.dev.mem
        mem[:host_end] = slot.staging.host_np[:host_end]
        header = mem[: slot.staging.header_bytes].view(np.int64)[: MAX_BATCH * PARAMS_PER_IMAGE].reshape(MAX_BATCH, -1)
        for j in range(bucket):
            row = header[j]
            if row[P_NEW_H] == 0:
                assert j >= len(placed)  # padding only after the batch's images
                continue
            h, w, offset = int(row[P_SRC_H]), int(row[P_SRC_W]), int(row[P_OFFSET])
            self.reads.append((offset, offset + h * w * 3))
            img = mem[offset : offset + h * w * 3].reshape(h, w, 3).copy()
            results[placed[j][0]] = img[..., ::-1].copy() if row[P_LAYOUT] == LAYOUT_HWC_RGB else img
            assert row[P_LAYOUT] in (LAYOUT_HWC_RGB, LAYOUT_HWC_BGR)
        return PipelineRun(results)


def as_input(item):
    """What a pipeline takes: bytes travel with the header their first reader parsed (a cut or
    corrupt JPEG's header says so; the pipeline refuses it on that), frames as they are."""
    if isinstance(item, bytes):
        return EncodedImage(item, read_header(item))
    if isinstance(item, types.SimpleNamespace):
        return EncodedImage(item.data, item.header)
    return item


@pytest.fixture
def pipeline(monkeypatch):
    """``GpuPipeline`` with its CUDA parts stood in for; ``pipeline.run_on(slot, images)``."""
    import app.gpu.driver
    from app.pipeline.gpu import GpuPipeline

    p = object.__new__(GpuPipeline)
    p.size, p.max_batch, p.buckets, p.host_threads = 640, MAX_BATCH, bucket_sizes(MAX_BATCH), 2
    p.pad_to_captured, p.max_pixels = False, MAX_PIXELS
    p._timeline, p._host_pool, p._pool_lock = None, None, threading.Lock()
    p._torch = types.SimpleNamespace(cuda=types.SimpleNamespace(stream=lambda stream: contextlib.nullcontext()))
    p.graph = Graph()
    p._launch = p.graph
    p.slot = Slot()
    p.decoder = StandInDecoder(lambda: p.slot.staging.dev.mem)
    p._decoders = Decoders(device=0, threads=2)
    p._decoders.by_name["gpu"] = p.decoder

    def upload(driver, copies, stream):  # OpenCV's frames of what the GPU refused, H2D into their places
        for dst, src, n in copies:
            p.slot.staging.dev.mem[dst : dst + n] = p.slot.staging.host_np[src : src + n]

    monkeypatch.setattr(app.gpu.driver, "cuda_driver", lambda: None)
    monkeypatch.setattr(app.gpu.driver, "copy_host_to_device", upload)
    p.run_on = lambda images: p._run(p.slot, [as_input(i) for i in images], DetectParams(), "gpu", False).images
    yield p
    if p._host_pool is not None:
        p._host_pool.shutdown()


@pytest.fixture(scope="module")
def photos(assets_dir) -> dict[str, bytes]:
    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    return {"bus": (assets_dir / "bus.jpg").read_bytes(), "zidane": (assets_dir / "zidane.jpg").read_bytes(),
            "bus_flipped": cv2.imencode(".jpg", bus[:, ::-1])[1].tobytes(),  # bus's size: the same place
            "bus_small": cv2.imencode(".jpg", cv2.resize(bus, (300, 400)))[1].tobytes()}


def cpu_error(data: bytes) -> str:
    with pytest.raises(InvalidImage) as info:
        decode_image(data)
    return str(info.value)


def opencv(data: bytes) -> np.ndarray:
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)


def assert_own_pixels(results, items):
    for out, data in zip(results, items):
        np.testing.assert_array_equal(out, opencv(data))


def test_cut_and_corrupt_jpegs_get_the_cpu_error_and_no_decoder_sees_them(pipeline, photos, forge):
    bus, zidane = photos["bus"], photos["zidane"]
    broken = {"cut_400": bus[:400], "cut_2000": bus[:2000], "cut_half": bus[: len(bus) // 2],
              "cut_90pct": zidane[: len(zidane) * 9 // 10], "no_eoi": zidane[:-2],
              "zero_length_scan": forge.jpeg_broken("bus", bus)["bus_zero_length_scan"],
              "dri_without_rst": forge.jpeg_with_dri(bus, 4)}
    frame = decode_image(photos["bus_small"])
    items = [bus, *broken.values(), zidane, frame]
    out = pipeline.run_on(items)
    for (name, data), got in zip(broken.items(), out[1:-2]):
        assert isinstance(got, InvalidImage), name
        assert str(got) == cpu_error(data) == "cannot decode this JPEG image (truncated or corrupt)", name
    assert_own_pixels([out[0], out[-2]], [bus, zidane])
    np.testing.assert_array_equal(out[-1], frame)
    assert pipeline.decoder.handed == [bus, zidane]  # the cut files never reached the decoder


def test_the_slot_that_held_a_photo_answers_a_cut_file_with_the_error_and_runs_no_graph(pipeline, photos):
    bus = photos["bus"]
    assert_own_pixels(pipeline.run_on([bus]), [bus])
    for cut in (bus[:400], bus[:2000], bus[: len(bus) // 2], bus[: len(bus) * 9 // 10], bus[:-2]):
        (got,) = pipeline.run_on([cut])
        assert isinstance(got, InvalidImage) and str(got) == cpu_error(cut)
    assert pipeline.graph.launches == 1


def test_a_decode_reported_failed_is_opencvs_pixels_not_the_half_written_ones(pipeline, photos):
    bus, flipped, zidane = photos["bus"], photos["bus_flipped"], photos["zidane"]
    assert_own_pixels(pipeline.run_on([bus, zidane]), [bus, zidane])
    pipeline.decoder.behaviour = {flipped: "half_fails"}
    out = pipeline.run_on([flipped, zidane])  # flipped takes bus's place in the same slot
    assert_own_pixels(out, [flipped, zidane])


def test_a_decode_that_is_an_error_leaves_the_batch_before_the_graph_runs(pipeline, photos):
    bus, small, zidane = photos["bus"], photos["bus_small"], photos["zidane"]
    pipeline.decoder.behaviour = {small: "error"}
    out = pipeline.run_on([bus, small, zidane])
    assert isinstance(out[1], InvalidImage) and "stand-in decoder failed" in str(out[1])
    assert_own_pixels([out[0], out[2]], [bus, zidane])
    start, end = pipeline.decoder.places[small]
    assert len(pipeline.graph.reads) == 2  # a batch of two: the failed image is not in it
    assert all(b <= start or a >= end for a, b in pipeline.graph.reads)  # and its place is read by nothing


def test_a_decoder_that_stops_early_yet_reports_success_shows_zeros_never_the_previous_image(pipeline, photos):
    bus, flipped = photos["bus"], photos["bus_flipped"]
    assert_own_pixels(pipeline.run_on([bus]), [bus])
    pipeline.decoder.behaviour = {flipped: "half_lies"}
    (got,) = pipeline.run_on([flipped])  # the same size: the same place bus was decoded into
    expected = decode_image(flipped).reshape(-1).copy()
    expected[expected.size // 2 :] = 0
    # the stand-in wrote the top half of RGB rows; read back as BGR the bottom half is zeros
    np.testing.assert_array_equal(got.reshape(-1)[: expected.size // 2 - 3], expected[: expected.size // 2 - 3])
    assert not got.reshape(-1)[expected.size // 2 + 3 :].any()


def test_the_decoder_takes_the_header_its_caller_read(pipeline, photos, monkeypatch):
    """An image that travels with its header (``EncodedImage(data, header)``) is not parsed
    again; one whose header says its bytes cannot decode whole is refused on that alone."""
    import app.gpu.decoded
    import app.imaging.decode

    bus, zidane = photos["bus"], photos["zidane"]
    headers = {bus: check_image(bus), zidane: check_image(zidane)}
    bad = headers[zidane]
    bad = type(bad)(**{**bad.__dict__, "jpeg": type(bad.jpeg)(**{**bad.jpeg.__dict__, "defect": "cut short"})})

    def no_parse(*args, **kwargs):
        raise AssertionError("the header was parsed again")

    monkeypatch.setattr(app.gpu.decoded, "read_header", no_parse)
    monkeypatch.setattr(app.imaging.decode, "check_image", no_parse)
    encoded = [types.SimpleNamespace(data=bus, header=headers[bus]), types.SimpleNamespace(data=zidane, header=bad)]
    out = pipeline.run_on(encoded)
    assert_own_pixels(out[:1], [bus])
    assert str(out[1]) == "cannot decode this JPEG image (truncated or corrupt)"
    assert pipeline.decoder.handed == [bus]
