"""Where the markers are in a JPEG's entropy-coded data (``app.imaging.jpeg_structure`` checks
them): every 0xFF followed by a byte that is neither 0x00 (a stuffed data byte) nor 0xFF (fill).

NumPy reads every byte, with the GIL let go (no Python loop per byte), in three passes after
which little is left: one flags each 0xFF; one keeps the flags whose next byte is not 0x00 (a
photo's few hundred 0xFF bytes are nearly all stuffing, its markers a handful); one marks each
8-byte word that still holds a flag, so that ``nonzero`` walks an eighth as many elements
(finding the 0xFF bytes themselves with ``nonzero`` cost more than the three passes). Python
then reads the usual one or two such words, where more NumPy calls would hold the GIL longer;
thousands of them (restart markers) are sorted out in NumPy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

RST0 = 0xD0
# libjpeg's limits, which both walks (``jpeg_structure``, ``jpeg_whole``) hold a frame and its scans to
MAX_SIDE = 65_500  # JPEG_MAX_DIMENSION
MAX_BLOCKS_IN_MCU = 10  # D_MAX_BLOCKS_IN_MCU
MAX_COMPONENTS = 10
MAX_COMPS_IN_SCAN = 4
_FEW_WORDS = 64  # up to this many 8-byte words holding a marker (or a fill byte) are read in Python


class Markers(NamedTuple):
    """The markers from an offset on, in order."""

    offsets: list[int]  # each one's 0xFF
    codes: np.ndarray | list[int]  # the byte after it
    ends: list[int]  # the indices (into offsets) of those that are not RSTn: each ends a scan's data


def find_markers(data: bytes, start: int) -> Markers:
    """Every marker of ``data`` from offset ``start`` on."""
    arr = np.frombuffer(data, np.uint8)
    last = len(data) - 1  # a marker's 0xFF has a byte after it
    size = max(last - start, 0)
    # flags[k]: 1 where data[start + k] is 0xFF and the byte after it is not 0x00 (a marker, or
    # a fill byte before one); the last word is padded with zeros to 8 bytes
    padded = np.empty(-(-size // 8) * 8, np.uint8)
    padded[size:] = 0
    flags = padded[:size]
    np.equal(arr[start:last], 0xFF, out=flags.view(bool))  # 1 at each 0xFF
    np.minimum(flags, arr[start + 1 :], out=flags)  # min(1, the next byte): 0 where that is 0x00
    words = (padded.view(np.uint64) != 0).nonzero()[0]  # those holding a flag
    if len(words) > _FEW_WORDS:  # restart markers, maybe thousands
        within = padded.reshape(-1, 8).take(words, 0).ravel().nonzero()[0]  # 8 * (k-th word) + byte
        at = words[within >> 3] * 8 + (within & 7) + start
        codes = arr[at + 1]
        markers = (codes != 0xFF).nonzero()[0]
        codes = codes[markers]
        return Markers(at[markers].tolist(), codes, ((codes & 0xF8) != RST0).nonzero()[0].tolist())
    offsets, codes_found, ends = [], [], []
    for word in words.tolist():
        at = start + 8 * word
        stop = min(at + 8, last)
        at = data.find(b"\xff", at, stop)
        while at >= 0:
            code = data[at + 1]
            if code and code != 0xFF:
                if code & 0xF8 != RST0:
                    ends.append(len(offsets))
                offsets.append(at)
                codes_found.append(code)
            at = data.find(b"\xff", at + 1, stop)
    return Markers(offsets, codes_found, ends)
