"""The frames between HTTP workers and inference workers: what goes in comes out, split anywhere."""

from __future__ import annotations

import pytest

from app.api.statuses import status_for
from app.contracts import DetectParams
from app.errors import DeviceError, Overloaded, UnsupportedMediaType
from app.ipc import wire


def test_images_round_trip_with_their_parameters():
    refs = [
        wire.ImageRef(7, 0, 123, 4567, 1e6 + 0.25, DetectParams()),
        wire.ImageRef(2**40, 3, 2**33, 99, 5.5, DetectParams(0.05, 0.3, 17, (0, 2, 79), True)),
    ]
    reader = wire.FrameReader()
    stream = b"".join(wire.image(r) for r in refs) + wire.cancel(2**40)
    frames = [f for i in range(0, len(stream), 5) for f in reader.feed(stream[i : i + 5])]  # 5-byte pieces
    assert [k for k, _ in frames] == [wire.IMAGE, wire.IMAGE, wire.CANCEL]
    assert [wire.read_image(b) for _, b in frames[:2]] == refs
    assert wire.read_cancel(frames[2][1]) == 2**40


def test_an_image_travels_with_the_header_the_http_worker_read(bus, forge):
    """The whole header, a JPEG's chroma sampling included (the GPU decoder routes by it), for
    every kind of JPEG (baseline and progressive, each subsampling, gray, CMYK, EXIF turns)."""
    from app.benchmark.workloads import varied_jpegs
    from app.imaging.check import check_image

    jpegs = [data for _, data in varied_jpegs(per_variant=1)]
    without_tables = forge.jpeg_without(bus, 0xC4)  # Motion-JPEG style: libjpeg's standard Huffman tables
    samplings = set()
    for data in (bus, without_tables, forge.png(64, 48), forge.tiff(64, 48, bits=16), *jpegs):
        header = check_image(data)
        ref = wire.ImageRef(1, 0, 0, len(data), 9.0, DetectParams(), header)
        ((_, body),) = wire.FrameReader().feed(wire.image(ref))
        back = wire.read_image(body)
        assert back.header == header
        assert back.header.jpeg is None or back.header.jpeg.gpu_decodable == header.jpeg.gpu_decodable
        assert (back.header.jpeg is not None) == (header.format == "jpeg")
        if header.jpeg is not None:
            samplings.add(header.jpeg.sampling)
    assert len(samplings) >= 5 and any(len(s) == 4 for s in samplings)  # the comparison saw variety
    ((_, body),) = wire.FrameReader().feed(wire.image(wire.ImageRef(1, 0, 0, 1, 9.0, DetectParams())))
    assert wire.read_image(body).header is None  # bytes from elsewhere: the worker reads the header itself


@pytest.mark.parametrize("error, status", [(Overloaded("busy"), 503), (DeviceError("gone"), 503),
                                           (UnsupportedMediaType("text"), 415)])
def test_errors_keep_their_class_and_so_their_status(error, status):
    restored = wire.error_from_code(error.code, str(error))
    assert type(restored) is type(error) and status_for(restored) == status


def test_the_status_block_is_shared_between_a_writer_and_readers(tmp_path):
    writer = wire.StatusBlock(tmp_path / "s", writable=True)
    reader = wire.StatusBlock(tmp_path / "s", writable=False)
    writer.write(wire.Load(3, wire.READY, 40, 0.002, 2))
    load = reader.read()
    assert load == wire.Load(3, wire.READY, 40, 0.002, 2)
    assert load.queued_s(10) == pytest.approx(50 * 0.002 / 2)
    writer.close()
    reader.close()


def _keep_writing_ready(path, times: int) -> None:
    block = wire.StatusBlock(path, writable=True)
    for i in range(times):
        block.write(wire.Load(1, wire.READY, i % 64, 0.002, 2))
    block.close()


def test_a_reader_in_another_process_never_sees_a_ready_worker_as_not_ready(tmp_path):
    import multiprocessing

    path = tmp_path / "status"
    writer = wire.StatusBlock(path, writable=True)
    writer.write(wire.Load(1, wire.READY, 0, 0.002, 2))
    reader = wire.StatusBlock(path, writable=False)
    process = multiprocessing.get_context("spawn").Process(target=_keep_writing_ready, args=(path, 500_000))
    process.start()
    states = set()
    while process.is_alive():  # read while it rewrites the block as fast as it can
        states |= {reader.read().state for _ in range(1000)}
    process.join()
    assert process.exitcode == 0 and states == {wire.READY}
    reader.close()
    writer.close()
