"""The shared-memory ring: what the writer puts is what the reader maps; space comes back in any order."""

from __future__ import annotations

import os

import pytest

from app.ipc.ring import Ring, map_ring


@pytest.fixture()
def ring(tmp_path):
    r = Ring(tmp_path / "ring", 1000)
    yield r
    r.close()


def test_the_reader_sees_the_bytes_even_after_the_file_is_unlinked(ring):
    view = map_ring(ring.path)
    a, b = os.urandom(300), os.urandom(200)
    oa, ob = ring.put(a), ring.put(b)
    ring.unlink()
    assert not ring.path.exists()
    assert bytes(view[oa : oa + 300]) == a and bytes(view[ob : ob + 200]) == b


def test_full_until_the_oldest_space_is_freed_then_wraps(ring):
    view = map_ring(ring.path)
    offsets = [ring.put(bytes([i]) * 300) for i in range(3)]
    assert offsets == [0, 300, 600]
    assert ring.put(b"x" * 200) is None  # 100 bytes left at the end, and the start is in use
    ring.free(300)  # freed out of order: the tail cannot move past 0 yet
    assert ring.put(b"x" * 200) is None
    ring.free(0)  # now the first 600 bytes are free
    wrapped = ring.put(b"w" * 500)
    assert wrapped == 0 and bytes(view[0:500]) == b"w" * 500
    assert bytes(view[600:900]) == bytes([2]) * 300  # the live one was not overwritten
    assert ring.put(b"y" * 100) is None  # between head (500) and tail (600): must stay strictly apart
    assert ring.used == 800


def test_an_empty_ring_starts_over_at_zero(ring):
    first = ring.put(b"a" * 400)
    second = ring.put(b"b" * 400)
    ring.free(second)
    ring.free(first)
    assert ring.used == 0
    assert ring.put(b"c" * 900) == 0  # the whole ring, not what was left after the head


def test_too_large_never_fits(ring):
    assert ring.put(b"z" * 1001) is None
