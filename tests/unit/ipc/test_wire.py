"""The frames between HTTP workers and inference workers: what goes in comes out, split anywhere."""

from __future__ import annotations

import pytest

from app.api.errors import status_for
from app.contracts import DetectParams
from app.errors import DeviceError, ImageTooLarge, Overloaded, UnsupportedMediaType
from app.ipc import wire


@pytest.fixture(scope="module")
def detected(cpu_detector, bus, zidane):
    return cpu_detector, cpu_detector.detect([bus, zidane], cpu_detector.params(conf=0.1))


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
    from dataclasses import replace

    from app.imaging.check import check_image

    for data in (bus, forge.png(64, 48), forge.tiff(64, 48, bits=16)):
        header = check_image(data)
        ref = wire.ImageRef(1, 0, 0, len(data), 9.0, DetectParams(), header)
        ((_, body),) = wire.FrameReader().feed(wire.image(ref))
        back = wire.read_image(body)
        expected = header if header.jpeg is None else replace(header, jpeg=replace(header.jpeg, sampling=()))
        assert back.header == expected
        assert (back.header.jpeg is not None) == (header.format == "jpeg")
    ((_, body),) = wire.FrameReader().feed(wire.image(wire.ImageRef(1, 0, 0, 1, 9.0, DetectParams())))
    assert wire.read_image(body).header is None  # bytes from elsewhere: the worker reads the header itself


def test_results_round_trip_to_the_same_json_as_the_detector(detected):
    det, results = detected
    outcomes = [wire.Outcome(1, i, r.width, r.height, r.detections, decode_ms=1.5, queue_ms=2.5)
                for i, r in enumerate(results)]
    outcomes.append(wire.Outcome(1, 2, error=ImageTooLarge("image has 2,500,000,000 pixels")))
    (kind, body), = wire.FrameReader().feed(wire.results(outcomes, {"batch_ms": 12.5, "batch_size": 2}))
    assert kind == wire.RESULTS
    timings, back = wire.read_results(body)
    assert timings == {"batch_ms": 12.5, "batch_size": 2}
    for o, r in zip(back, results):
        assert (o.width, o.height) == (r.width, r.height)
        assert o.detections.to_json(det.names) == r.detections.to_json(det.names) != []
        assert (o.decode_ms, o.queue_ms, o.batch) == (1.5, 2.5, timings)
    assert type(back[2].error) is ImageTooLarge and status_for(back[2].error) == 413
    assert str(back[2].error) == "image has 2,500,000,000 pixels"


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


def test_each_owner_gets_its_share_of_a_batch_in_one_frame(detected):
    """A batch's answers to three HTTP workers: each frame holds that worker's answers, rows
    and errors included, and nothing of the others'."""
    from app.ipc.batcher import Job
    from app.service.worker import answer_frames

    det, (bus_result, zidane_result) = detected
    results = [bus_result, zidane_result, None, zidane_result, bus_result]
    owners = ["a", "b", "a", "c", "a"]
    outcomes = [wire.Outcome(5, i, r.width, r.height, r.detections) if r is not None else
                wire.Outcome(5, i, error=ImageTooLarge("too big")) for i, r in enumerate(results)]
    jobs = [Job(owner, wire.ImageRef(5, i, 0, 0, 0.0, DetectParams()), None) for i, owner in enumerate(owners)]
    frames = answer_frames(jobs, wire.Answers.of(outcomes, {"batch_ms": 3.0}))
    assert [owner for owner, _ in frames] == ["a", "b", "c"]
    for owner, data in frames:
        ((_, body),) = wire.FrameReader().feed(data)
        timings, back = wire.read_results(body)
        assert timings == {"batch_ms": 3.0}
        assert [o.index for o in back] == [i for i, o in enumerate(owners) if o == owner]
        for o in back:
            expected = results[o.index]
            if expected is None:
                assert type(o.error) is ImageTooLarge and str(o.error) == "too big"
            else:
                assert o.detections.to_json(det.names) == expected.detections.to_json(det.names) != []
