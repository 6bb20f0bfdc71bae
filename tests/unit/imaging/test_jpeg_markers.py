"""The markers of a JPEG's entropy-coded data against their definition, read byte by byte: every
0xFF whose next byte is neither 0x00 (stuffing) nor 0xFF (fill). Photos (baseline, progressive,
with restart intervals: thousands of RSTn) and random bytes dense in 0xFF, 0x00, fill runs and
RSTn, from every kind of offset; every short length (the search pads the last 8-byte word), and
markers, fill runs and stuffing at every offset of a word, few of them and many."""

from __future__ import annotations

import cv2
import numpy as np

from app.imaging.jpeg_markers import _FEW_WORDS, find_markers


def _by_definition(data: bytes, start: int) -> tuple[list[int], list[int], list[int]]:
    offsets, codes, ends = [], [], []
    for i in range(start, len(data) - 1):
        if data[i] == 0xFF and data[i + 1] not in (0x00, 0xFF):
            if not 0xD0 <= data[i + 1] <= 0xD7:
                ends.append(len(offsets))
            offsets.append(i)
            codes.append(data[i + 1])
    return offsets, codes, ends


def _found(data: bytes, start: int) -> tuple[list[int], list[int], list[int]]:
    markers = find_markers(data, start)
    return markers.offsets, [int(c) for c in markers.codes], markers.ends


def test_the_markers_of_photos_are_those_of_the_definition(assets_dir, forge):
    bus = (assets_dir / "bus.jpg").read_bytes()
    img = cv2.imdecode(np.frombuffer(bus, np.uint8), cv2.IMREAD_COLOR)
    photos = {"bus": bus, "zidane": (assets_dir / "zidane.jpg").read_bytes(),
              "progressive": cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes(),
              "restarts": cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_RST_INTERVAL, 1])[1].tobytes()}
    many = 0
    for name, data in photos.items():
        scan_data = forge.jpeg_segments(data)[-1][2]
        for start in (scan_data, 0, 2, scan_data + 1, len(data) - 2, len(data) - 1, len(data)):
            assert _found(data, start) == _by_definition(data, start), (name, start)
        many = max(many, len(find_markers(data, scan_data).offsets))
    assert many > 1000  # restart markers: the NumPy way past the few markers of a photo


def test_the_markers_of_random_bytes_are_those_of_the_definition():
    rng = np.random.default_rng(0)
    values = np.array([0xFF, 0x00, 0xD0, 0xD3, 0xD7, 0xD9, 0xDA, 0xC4, 0x01, 0x55], np.uint8)
    counts = set()
    for k in range(400):
        size = int(rng.integers(0, 3000))
        weights = rng.dirichlet(np.ones(len(values)))  # from sparse to dense 0xFF, fill runs, RSTn
        data = rng.choice(values, size, p=weights).tobytes()
        if k % 4 == 0:
            data = data.replace(b"\xff", b"\xff\xff\xff", 5)  # fill runs
        start = int(rng.integers(0, len(data) + 1))
        expected = _by_definition(data, start)
        assert _found(data, start) == expected, (k, start)
        counts.add(min(len(expected[0]) // 32, 3))
    assert counts == {0, 1, 2, 3}  # few markers and many (past 64)


def test_the_markers_of_short_bytes_are_those_of_the_definition():
    """Lengths 0 to 17 from every start: whole words, a padded last word, a 0xFF as the last byte."""
    rng = np.random.default_rng(1)
    values = np.array([0xFF, 0x00, 0xD0, 0xD9, 0x55], np.uint8)
    for size in range(18):
        for _ in range(60):
            data = rng.choice(values, size).tobytes()
            for start in range(size + 2):
                assert _found(data, start) == _by_definition(data, start), (data, start)


def test_the_markers_at_every_offset_of_a_word_are_those_of_the_definition():
    """A marker, a fill run before one, a stuffed 0xFF, amid stuffed data, at every offset of an
    8-byte word and across two; one of them, and more than the few words read in Python; and
    data that ends in a 0xFF."""
    filler = b"\x12\xff\x00\x34\x56\xff\x00\x78\x9a"  # 9 bytes and more a copy: each lands further on
    for pattern in (b"\xff\xd9", b"\xff\xd3", b"\xff\xff\xff\xc4", b"\xff\x00", b"\xff\x01", b"\xff"):
        for copies in (1, _FEW_WORDS + 8):
            for lead in range(9):
                data = bytes(lead) + (filler + pattern + b"\x11" * (lead % 3)) * copies + filler[:lead]
                for start in (0, lead, lead + 1, len(data) - 9):
                    expected = _by_definition(data, start)
                    assert _found(data, start) == expected, (pattern, copies, lead, start)
                if copies > 1 and pattern not in (b"\xff\x00", b"\xff"):  # a marker in each of them
                    assert len(_by_definition(data, 0)[0]) >= copies > _FEW_WORDS
