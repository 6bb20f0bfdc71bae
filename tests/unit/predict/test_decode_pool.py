"""The NVDEC decode pool (``app.predict.decode_pool``) through the stream runner, on a CPU:
NVDEC captures stood in for by ``FakeNvdec`` (device frames out of a decode call that takes the
time NVDEC would, without the GIL) and the model by ``tests.standins.Answers``. Many streams
read at their source rate by a few decoder threads keep that rate, each frame handed over when
it is due and not before; files read as fast as possible never drop; a failing capture fails its
stream alone; a stopped stream gets its capture back."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from app.contracts import DeviceNv12
from app.pipeline.detector import Detector
from app.predict import stream_source
from app.predict import streams as streams_module
from app.predict.streams import StreamRunner
from tests.stalls import StallWatch
from tests.standins import Answers


class FakeNvdec:
    """``frames`` frames of 64x48 at ``fps``; a decode call of n frames sleeps ``call_s + n * frame_s``."""

    def __init__(self, frames: int, fps: float = 30.0, *, call_s: float = 0.002, frame_s: float = 0.0005,
                 fail_after: int | None = None) -> None:
        self.fps, self.width, self.height = fps, 64, 48
        self.left, self.given, self.fail_after = frames, 0, fail_after
        self.call_s, self.frame_s = call_s, frame_s
        self.calls: list[int] = []
        self.released = False
        self.readers: set[str] = set()

    def read(self, count: int) -> list[DeviceNv12]:
        self.readers.add(threading.current_thread().name)
        self.last_reader = threading.current_thread().name
        if self.fail_after is not None and self.given >= self.fail_after:
            raise RuntimeError("NVDEC lost the stream")
        n = min(count, self.left)
        self.calls.append(n)
        time.sleep(self.call_s + n * self.frame_s)
        self.left -= n
        self.given += n
        return [DeviceNv12(None, self.height, self.width) for _ in range(n)]

    def release(self) -> None:
        self.released = True


@pytest.fixture
def nvdec_runner(monkeypatch):
    """A runner whose streams read ``FakeNvdec`` captures (``caps[source]``) through a pool of 3."""
    caps: dict[str, FakeNvdec] = {}
    monkeypatch.setenv("YOLOPIPE_NVDEC_THREADS", "3")
    monkeypatch.setattr(streams_module, "video_decoder", lambda detector: "nvdec")
    monkeypatch.setattr(stream_source, "open_source", lambda source, decoder, **kw: caps[source])

    def make(answers: Answers, on_frames, **kwargs) -> StreamRunner:
        return StreamRunner(Detector(answers), answers and Detector(answers).params(), on_frames, **kwargs)

    return caps, make


def test_many_paced_streams_from_three_decoder_threads(nvdec_runner):
    caps, make = nvdec_runner
    n, frames, fps = 24, 45, 30.0
    for k in range(n):
        caps[f"cam{k}"] = FakeNvdec(frames, fps)
    times: dict[str, list[tuple[int, float]]] = {}
    lock = threading.Lock()

    def on_frames(batch, answers, ids):
        with lock:
            for f in batch:
                times.setdefault(f.stream.id, []).append((f.index, f.captured))

    answers = Answers(max_batch=32, per_batch_s=0.003, takes_nv12=True)
    runner = make(answers, on_frames, max_streams=n, max_wait_ms=5)
    assert runner.pool is not None and runner.pool.size == 3
    t0 = time.monotonic()
    with StallWatch() as watch:
        streams = [runner.add(f"cam{k}", stream_id=f"cam{k}", realtime=True) for k in range(n)]
        runner.run(until_done=True)
    wall = time.monotonic() - t0
    assert [s.state for s in streams] == ["ended"] * n
    assert all(caps[f"cam{k}"].released for k in range(n))
    readers = set().union(*(c.readers for c in caps.values()))
    assert len(readers) <= 3 and all(r.startswith("yolopipe-decode-") for r in readers), readers
    assert max(max(c.calls) for c in caps.values()) > 1, "frames are decoded a batch at a time"
    stalled = watch.longest_s >= 1 / fps  # this process went a frame's time without running
    for s in streams:
        got = times[s.id]
        indices = [i for i, _ in got]
        assert s.stats.frames_read == frames, s.id  # the pool read every frame
        assert indices == sorted(set(indices)), s.id  # in order
        assert len(got) + s.stats.dropped == frames, s.id  # each frame answered or counted dropped
        assert s.stats.dropped == 0 or stalled, (s.id, indices, watch.longest_s)
        late = np.array([t - i / fps for i, t in got])  # each frame's time less its place in the schedule
        late -= late.min()
        assert got[-1][1] - got[0][1] > (frames - 1) / fps - 0.03, (s.id, "handed over faster than the source rate")
        assert np.median(late) < 0.03, (s.id, np.median(late))  # at the source's rate, not behind it
    assert wall < (frames / fps) * 1.6 + 2.0, wall


def test_files_as_fast_as_possible_never_drop(nvdec_runner):
    caps, make = nvdec_runner
    for k in range(6):
        caps[f"file{k}"] = FakeNvdec(40, call_s=0.0, frame_s=0.0)
    seen: dict[str, list[int]] = {}

    def on_frames(batch, answers, ids):
        for f in batch:
            seen.setdefault(f.stream.id, []).append(f.index)

    answers = Answers(max_batch=8, per_batch_s=0.004, takes_nv12=True)  # slower than decoding: buffers fill
    runner = make(answers, on_frames, max_streams=6)
    streams = [runner.add(f"file{k}", stream_id=f"file{k}") for k in range(6)]
    runner.run(until_done=True)
    assert all(seen[s.id] == list(range(40)) for s in streams)
    assert sum(s.stats.dropped for s in streams) == 0
    assert max(answers.batches) == 8


def test_a_failing_capture_fails_its_stream_alone(nvdec_runner):
    caps, make = nvdec_runner
    caps["bad"] = FakeNvdec(30, fail_after=8)
    caps["good"] = FakeNvdec(30)
    answers = Answers(takes_nv12=True)
    runner = make(answers, lambda *a: None, max_streams=2)
    bad, good = runner.add("bad", realtime=True), runner.add("good", realtime=True)
    runner.run(until_done=True)
    assert bad.state == "failed" and "NVDEC lost the stream" in bad.error
    assert good.state == "ended" and good.stats.frames_done == 30
    assert caps["bad"].released and caps["good"].released


def test_a_removed_stream_gets_its_capture_back(nvdec_runner):
    caps, make = nvdec_runner
    caps["long"] = FakeNvdec(10_000)
    runner = make(Answers(takes_nv12=True), lambda *a: None, max_streams=1)
    thread = threading.Thread(target=runner.run, kwargs={"until_done": False}, daemon=True)
    thread.start()
    stream = runner.add("long", realtime=True)
    deadline = time.monotonic() + 20
    while stream.stats.frames_done < 5:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert runner.remove(stream.id)
    stream.join(timeout=10)
    assert not stream.reading and caps["long"].released and stream.state == "removed"
    runner.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_each_stream_makes_room_for_its_frames_before_the_pool_reads_them(nvdec_runner):
    """The runner captures the NV12 graphs before any reader starts, and before a stream's
    frames are read has the pipeline make room for a batch of them (so that no batch grows the
    staging, and captures, while the pool decodes); a stream whose preparation fails fails alone."""
    caps, make = nvdec_runner
    answers = Answers(takes_nv12=True)

    class Checked(FakeNvdec):
        def read(self, count):
            assert (True, (self.height, self.width)) in answers.warmups, answers.warmups
            return super().read(count)

    caps["a"], caps["b"] = Checked(12), Checked(12)
    caps["b"].width, caps["b"].height = 80, 60
    runner = make(answers, lambda *a: None, max_streams=3)
    assert answers.warmups == [(True, None)]  # at start, before any stream
    a, b = runner.add("a"), runner.add("b")
    runner.run(until_done=True)
    assert a.state == b.state == "ended" and a.stats.frames_done == b.stats.frames_done == 12
    assert sorted(answers.warmups[1:]) == [(True, (48, 64)), (True, (60, 80))]

    def refused(batches=None, *, nv12=False, frame_size=None):
        if frame_size is not None:
            raise RuntimeError("no room on the device")

    answers.warmup = refused
    caps["c"] = FakeNvdec(12)
    runner = make(answers, lambda *a: None, max_streams=1)
    c = runner.add("c")
    runner.run(until_done=True)
    assert c.state == "failed" and "no room on the device" in c.error and caps["c"].calls == []


class StuckNvdec(FakeNvdec):
    """Gives ``before`` frames, then its next decode call blocks until ``let_go`` is set, as a live
    source's read does while its packets have stopped coming; then its end."""

    def __init__(self, before: int, **kwargs) -> None:
        super().__init__(10_000, **kwargs)
        self.before = before
        self.stuck, self.let_go = threading.Event(), threading.Event()

    def read(self, count: int) -> list[DeviceNv12]:
        if self.given >= self.before:
            self.readers.add(threading.current_thread().name)
            self.stuck.set()
            self.let_go.wait(60)
            return []
        return super().read(min(count, self.before - self.given))


def test_a_stalled_capture_holds_only_its_own_stream(nvdec_runner, caplog):
    """Nine paced streams over three decode threads: the one whose decode call does not come back
    keeps its thread; the two streams that shared that thread go one to each other thread and
    end on time, every frame read, while the stalled call still waits."""
    caps, make = nvdec_runner
    frames, fps = 60, 30.0
    caps["stuck"] = StuckNvdec(5)
    good = [f"cam{k}" for k in range(8)]
    for name in good:
        caps[name] = FakeNvdec(frames, fps)
    runner = make(Answers(max_batch=16, takes_nv12=True), lambda *a: None, max_streams=9, max_wait_ms=5)
    stuck = runner.add("stuck", stream_id="stuck", realtime=True)
    streams = [runner.add(name, stream_id=name, realtime=True) for name in good]
    thread = threading.Thread(target=runner.run, kwargs={"until_done": True}, daemon=True)
    t0 = time.monotonic()
    thread.start()
    try:
        while any(s.state != "ended" for s in streams) and time.monotonic() - t0 < 20:
            time.sleep(0.02)
        ended_s = time.monotonic() - t0
        assert [s.state for s in streams] == ["ended"] * 8, [(s.id, s.state, s.stats.frames_read) for s in streams]
        assert caps["stuck"].stuck.is_set() and stuck.state == "live"
        assert all(s.stats.frames_read == frames for s in streams)
        # the stalled thread had two other streams (nine over three), handed one to each other thread
        (stalled_thread,) = caps["stuck"].readers
        taken = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
        assert len(taken) == 1 and taken[0].startswith(f"decode thread {stalled_thread} stalled"), taken
        assert taken[0].endswith("its 2 other stream(s) go to other threads"), taken
        last = [caps[name].last_reader for name in good]
        assert stalled_thread not in last and sorted(last.count(t) for t in set(last)) == [4, 4], last
        # on time but for the stall's second: not held until the stalled call came back
        assert ended_s < frames / fps + 1.0 + 3.0, ended_s
    finally:
        caps["stuck"].let_go.set()
        thread.join(timeout=20)
    assert not thread.is_alive() and stuck.state == "ended"


class _Sink:
    """The stream side of ``DecodePool.read``: a file read as fast as possible, every frame kept."""

    period, vid_stride, stopped = 0.0, 1, False

    def __init__(self) -> None:
        self.kept: list[int] = []

    def room(self) -> int:
        return 8

    def keep(self, index: int, frame) -> None:
        self.kept.append(index)


def test_a_decode_thread_that_ends_fails_its_streams_and_is_replaced(caplog):
    from app.errors import DeviceError
    from app.predict.decode_pool import DecodePool

    starts: list[str] = []

    @contextlib.contextmanager
    def on_device():
        starts.append(threading.current_thread().name)
        if len(starts) == 1:
            raise RuntimeError("no CUDA context")
        yield

    pool = DecodePool(1, on_device=on_device)
    outcome: list = []

    def read() -> None:
        try:
            outcome.append(pool.read(_Sink(), FakeNvdec(10, call_s=0.0, frame_s=0.0), 0))
        except Exception as exc:  # noqa: BLE001 - what the stream's thread would fail with
            outcome.append(exc)

    for _ in range(2):
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive(), "a stream waits on a decode thread that is gone"
    pool.close()
    first, second = outcome
    assert isinstance(first, DeviceError) and "no CUDA context" in str(first), first
    assert second == 10  # a new thread read the next stream whole
    assert len(set(starts)) == 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"decode thread {starts[0]} ended: RuntimeError: no CUDA context"]


class _Held(FakeNvdec):
    """Its second decode call waits ``held_s``, as every decode call waits while a capture holds
    the device (``holding`` set meanwhile)."""

    def __init__(self, held_s: float, holding: threading.Event, **kwargs) -> None:
        super().__init__(1_000, call_s=0.0, frame_s=0.0, **kwargs)
        self.held_s, self.holding = held_s, holding

    def read(self, count: int) -> list[DeviceNv12]:
        if len(self.calls) == 1:
            self.holding.set()
            time.sleep(self.held_s)
            self.holding.clear()
        return super().read(count)


@pytest.mark.parametrize("capture", [True, False], ids=["a-capture-held-the-device", "nothing-held-it"])
def test_a_call_that_waits_out_a_capture_is_not_a_stall(capture, caplog):
    """Two threads, three streams: the first thread's call waits 1.5 s. Where a capture held the
    device meanwhile (``open_since``), that wait is no stall: the stream sharing that thread stays
    there. Where nothing held it, the call is stalled and the other thread takes that stream."""
    from app.predict.decode_pool import DecodePool

    holding, let_go = threading.Event(), [0.0]

    def open_since() -> float:
        if capture and holding.is_set():
            return time.monotonic()
        return let_go[0]

    pool = DecodePool(2, open_since=open_since)
    held = _Held(1.5, holding)
    other, sharing = FakeNvdec(300, call_s=0.002), FakeNvdec(300, call_s=0.002)
    readers = []
    for cap in (held, other, sharing):
        reader = threading.Thread(target=pool.read, args=(_Sink(), cap, 0), daemon=True)
        reader.start()
        readers.append(reader)
        deadline = time.monotonic() + 5
        while not cap.readers and cap is not sharing and time.monotonic() < deadline:
            time.sleep(0.005)  # each of the first two has its own thread before the next comes
    for reader in readers:
        reader.join(timeout=20)
    pool.close()
    assert not any(r.is_alive() for r in readers)
    assert held.given == 1_000 and other.given == sharing.given == 300
    (held_thread,) = held.readers
    stalled = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    if capture:
        assert sharing.readers == {held_thread} and stalled == []
    else:
        assert sharing.readers and held_thread not in sharing.readers
        assert len(stalled) == 1 and stalled[0].startswith(f"decode thread {held_thread} stalled"), stalled
