"""Where the markers are in a JPEG's entropy-coded data (``app.imaging.jpeg_structure`` checks
them): every 0xFF followed by a byte that is neither 0x00 (a stuffed data byte) nor 0xFF (fill).

NumPy finds the 0xFF bytes, with the GIL let go (no Python loop per byte). What follows works
on those alone (a few hundred in a photo), and sorts the usual handful of markers among them in
Python, where more NumPy calls would hold the GIL longer.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

RST0 = 0xD0


class Markers(NamedTuple):
    """The markers from an offset on, in order."""

    offsets: list[int]  # each one's 0xFF
    codes: np.ndarray | list[int]  # the byte after it
    ends: list[int]  # the indices (into offsets) of those that are not RSTn: each ends a scan's data


def find_markers(data: bytes, start: int) -> Markers:
    """Every marker of ``data`` from offset ``start`` on."""
    arr = np.frombuffer(data, np.uint8)
    ff = (arr[start:-1] == 0xFF).nonzero()[0]  # NumPy lets the GIL go for these two passes
    after = arr[start + 1 :][ff]  # the byte after each 0xFF
    hit = after.nonzero()[0]  # not a stuffed 0x00: a marker, or a fill byte before one
    if len(hit) > 64:  # restart markers, maybe thousands
        hit = hit[after[hit] != 0xFF]
        codes = after[hit]
        offsets = (ff[hit] + start).tolist()
        return Markers(offsets, codes, ((codes & 0xF8) != RST0).nonzero()[0].tolist())
    offsets, codes_found, ends = [], [], []
    for at, code in zip((ff[hit] + start).tolist(), after[hit].tolist()):
        if code != 0xFF:
            if code & 0xF8 != RST0:
                ends.append(len(offsets))
            offsets.append(at)
            codes_found.append(code)
    return Markers(offsets, codes_found, ends)
