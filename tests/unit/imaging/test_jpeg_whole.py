"""The compiled walk (``app.imaging.jpeg_whole``) answers only where the Python walk finds the JPEG
whole, and then as it does: over the corpus of broken files, the photos of every kind, and random
mutations of them (bytes of the headers and the scan data changed, markers dropped into the data,
restart markers moved), ``walk_jpeg`` equals ``walk_jpeg_python`` in every field, at every scan
limit. And it does answer for the photos, so the GIL-free path is the one they take. Until a
run asks for it (``use_compiled_walk``), nothing loads Numba for it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from app.imaging import jpeg_structure, jpeg_whole
from app.imaging.jpeg_structure import JpegStructure, walk_jpeg, walk_jpeg_python

SCAN_LIMITS = (None, 0, 1, 3)


@pytest.fixture(autouse=True)
def compiled_walk(monkeypatch):
    monkeypatch.setattr(jpeg_structure, "_compiled_walk", None)  # as it was, after the test
    jpeg_structure.use_compiled_walk()


def _compiled(data: bytes, max_scans: int | None = None) -> int:
    return jpeg_whole.whole_scans(np.frombuffer(data, np.uint8), -1 if max_scans is None else max_scans)


def _mutations(forge, data: bytes, rng: np.random.Generator, count: int) -> list[bytes]:
    """Changes the structure walk must see or rightly ignore: a header byte set, a scan byte set
    (0xFF, an RSTn, anything), a marker dropped into the scan data, an RSTn removed or doubled."""
    segments = forge.jpeg_segments(data)
    data_at = segments[-1][2]
    markers = [at for at, code in forge.jpeg_markers(data) if at >= data_at]
    out = []
    for _ in range(count):
        b = bytearray(data)
        kind = int(rng.integers(0, 4))
        if kind == 0:  # a byte of the headers
            b[int(rng.integers(2, data_at))] = int(rng.choice([0, 1, 0x10, 0x40, 0xC0, 0xD0, 0xFF, rng.integers(256)]))
        elif kind == 1:  # a byte of the scan data
            b[int(rng.integers(data_at, len(b)))] = int(rng.choice([0xFF, 0x00, 0xD0 + rng.integers(8), rng.integers(256)]))
        elif kind == 2:  # a marker inside the scan data
            at = int(rng.integers(data_at, len(b)))
            b[at:at] = bytes([0xFF, int(rng.choice([0xD0 + rng.integers(8), 0xD9, 0xC4, 0xFF, 0x01, rng.integers(256)]))])
        elif markers:  # a marker of the data removed or doubled
            at = markers[int(rng.integers(len(markers)))]
            b[at : at + 2] = b"" if rng.random() < 0.5 else bytes(b[at : at + 2]) * 2
        out.append(bytes(b))
    return out


def test_the_photos_of_every_kind_are_decided_compiled(sources):
    for name, data in sources.items():
        assert _compiled(data) == walk_jpeg_python(data).scans >= 1, name
        assert walk_jpeg(data) == JpegStructure(None, False, walk_jpeg_python(data).scans)


def test_the_walk_equals_the_python_walk_on_the_broken_corpus(corpus):
    decided = 0
    for name, data in corpus.items():
        for limit in SCAN_LIMITS:
            python = walk_jpeg_python(data, max_scans=limit)
            compiled = _compiled(data, limit)
            if compiled != jpeg_whole.ASK_PYTHON:
                decided += 1
                assert python == JpegStructure(None, False, compiled), (name, limit)
            assert walk_jpeg(data, max_scans=limit) == python, (name, limit)
    # the photos and what stays whole (bytes after the EOI, bit flips inside the data) at every
    # limit; every defect goes to the Python walk
    assert decided >= 4 * 10 + 40


@pytest.mark.parametrize("seed", range(4))
def test_the_walk_equals_the_python_walk_on_random_mutations(sources, forge, seed):
    rng = np.random.default_rng(seed)
    verdicts = {"whole": 0, "defect": 0}
    for name, data in sources.items():
        for mutated in _mutations(forge, data, rng, 60):
            for limit in SCAN_LIMITS:
                python = walk_jpeg_python(mutated, max_scans=limit)
                assert walk_jpeg(mutated, max_scans=limit) == python, (name, limit, seed)
            verdicts["whole" if python.defect is None else "defect"] += 1
    assert verdicts["whole"] > 50 and verdicts["defect"] > 50, verdicts


def test_data_shorter_than_a_word_and_no_jpeg_at_all():
    for data in (b"", b"\xff", b"\xff\xd8", b"\xff\xd8\xff\xd9", b"\xff\xd8\xff\xda\x00", b"GIF89a", bytes(7)):
        assert _compiled(data) == jpeg_whole.ASK_PYTHON
        assert walk_jpeg(data) == walk_jpeg_python(data)


def test_the_walk_loads_no_numba_until_a_run_asks_for_it(assets_dir):
    code = f"""
import sys
from app.imaging.check import check_image
check_image(open({str(assets_dir / "bus.jpg")!r}, "rb").read())
print("numba" in sys.modules)
from app.imaging.jpeg_structure import use_compiled_walk
use_compiled_walk()
print("numba" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert proc.stdout.split() == ["False", "True"]


def test_the_load_is_of_the_compiled_walk_the_walks_call(assets_dir):
    """The load compiles (or loads from the cache) the walk for what ``walk_jpeg`` passes it, a
    read-only array of the bytes (of a bytearray or memoryview as well): the first walks after it
    add no signature (a writable warm-up left the first walk to compile again, holding the GIL
    for seconds on an empty cache)."""
    code = f"""
from app.imaging import jpeg_whole
from app.imaging.jpeg_structure import use_compiled_walk, walk_jpeg
use_compiled_walk()
loaded = list(jpeg_whole.whole_scans.signatures)
data = open({str(assets_dir / "bus.jpg")!r}, "rb").read()
for given in (data, bytearray(data), memoryview(bytearray(data))):
    assert walk_jpeg(given).defect is None
print(len(loaded), jpeg_whole.whole_scans.signatures == loaded)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert proc.stdout.split() == ["1", "True"]


def test_a_load_on_its_own_thread_leaves_the_walks_in_python_until_it_is_done(monkeypatch, sources):
    """``use_compiled_walk(wait=False)`` returns at once with the loading thread; walks meanwhile
    take the Python walk (the load is held back here until the test lets it go), then the
    compiled one; once loaded, no thread is started again. Two loads at once load it once."""
    import threading

    monkeypatch.setattr(jpeg_structure, "_compiled_walk", None)
    let_go, loads, whole_scans = threading.Event(), [], jpeg_whole.whole_scans

    def held_load(data, max_scans):
        loads.append(len(data))
        assert let_go.wait(60)
        return whole_scans(data, max_scans)

    monkeypatch.setattr(jpeg_whole, "whole_scans", held_load)
    first = jpeg_structure.use_compiled_walk(wait=False)
    second = jpeg_structure.use_compiled_walk(wait=False)
    assert first is not None and second is not None and not first.daemon  # an exit waits for it
    python_walks = []
    monkeypatch.setattr(jpeg_structure, "walk_jpeg_python", lambda data, **kw: python_walks.append(1) or
                        walk_jpeg_python(data, **kw))
    assert walk_jpeg(sources["bus"]) == walk_jpeg_python(sources["bus"]) and python_walks == [1]
    let_go.set()
    first.join(60)
    second.join(60)
    assert jpeg_structure._compiled_walk is held_load and loads == [2]  # one load, of its two-byte warm-up
    assert jpeg_structure.use_compiled_walk(wait=False) is None
    assert walk_jpeg(sources["bus"]) == walk_jpeg_python(sources["bus"]) and python_walks == [1]


def test_a_process_that_ends_while_the_walk_compiles_waits_for_it(tmp_path):
    """A run shorter than the first compile (an empty Numba cache): the process still ends cleanly,
    after the compile, whose cache the next process loads."""
    code = """
from app.imaging.jpeg_structure import use_compiled_walk
use_compiled_walk(wait=False)
"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(tmp_path.rglob("*whole_scans*.nbi")) and list(tmp_path.rglob("*whole_scans*.nbc"))


def test_where_the_compiled_walk_cannot_load_the_python_walk_stays(monkeypatch, sources):
    """Numba refuses a cached function where it finds nowhere to write its cache (a read-only
    install, no writable home): the run goes on with the Python walk."""
    import types

    def refuse(*args):
        raise RuntimeError("cannot cache function 'whole_scans': no locator available")

    monkeypatch.setattr(jpeg_structure, "_compiled_walk", None)
    monkeypatch.setitem(sys.modules, "app.imaging.jpeg_whole", types.SimpleNamespace(whole_scans=refuse))
    monkeypatch.delattr("app.imaging.jpeg_whole", raising=False)
    jpeg_structure.use_compiled_walk()
    assert jpeg_structure._compiled_walk is None
    assert walk_jpeg(sources["bus"]) == walk_jpeg_python(sources["bus"])
