"""The byte-structure walk of ``app.imaging.jpeg_structure`` for the JPEGs cameras and encoders
write, compiled (Numba, without the GIL): ``whole_scans`` says a JPEG is whole, or hands it to the
Python walk.

Why: every JPEG is walked before a GPU decoder sees it, on the threads that read the files or the
requests, and in Python the walk held the GIL about 90 µs an image (and its NumPy passes took 50
more). ``predict``'s one reader thread then took 11.9 ms for a batch of 64 on an H100 whose engine
took 9.4 (``bench/results/2026-12-07-nvidia-h100-predict-host-profile.json``).

The contract: ``whole_scans`` returns a scan count only where the Python walk finds no defect,
does not ask for libjpeg, and counts the same scans; anything else, or anything out of the
ordinary (fill bytes between segments, arithmetic, lossless or hierarchical frames, a table a
scan uses that is missing or bad, restart markers that do not fit), returns ``ASK_PYTHON``, and
the Python walk, which says what is wrong in words, decides. So the answers cannot differ, and
the tests check that they do not over the corpora and mutations of real photos. Every read is
checked against the data's end here (Numba checks no bounds).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from app.imaging.jpeg_markers import MAX_BLOCKS_IN_MCU, MAX_COMPONENTS, MAX_COMPS_IN_SCAN, MAX_SIDE

ASK_PYTHON = -1
_UNDEFINED, _FITS, _BAD = 0, 1, 2  # a Huffman table's state


@njit(nogil=True, cache=True)
def _codes_fit(d, at):  # pragma: no cover - compiled
    """libjpeg's check of the 16 code-length counts at ``d[at:at + 16]`` (``jpeg_structure._codes_fit``)."""
    space = 0
    for length in range(1, 17):
        space += d[at + length - 1] * (1 << (16 - length))
    return space < (1 << 16)


_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_BYTE, _TO_TOP = np.uint64(8), np.uint64(56)
_BLOCK = 32  # words whose flags are OR-ed together before any one is looked at


@njit(nogil=True, cache=True, inline="always")
def _zero_bytes(v):  # pragma: no cover - compiled
    """0x80 in each byte of ``v`` that is zero, nothing elsewhere (no carry crosses a byte)."""
    return ~(((v & _LOW7) + _LOW7) | v | _LOW7)


@njit(nogil=True, cache=True, inline="always")
def _marker_bytes(x, following):  # pragma: no cover - compiled
    """0x80 in each byte of the word ``x`` that is 0xFF followed by a byte other than 0x00 (a
    marker's 0xFF, or fill); ``following``: the next word, whose first byte follows ``x``'s last."""
    after_zero = (_zero_bytes(x) >> _BYTE) | (_zero_bytes(following) << _TO_TOP)
    return _zero_bytes(~x) & ~after_zero


@njit(nogil=True, cache=True, inline="always")
def _restart(p, code, found, previous):  # pragma: no cover - compiled
    """At the marker ``code`` at ``p``: 1 if it ends the scan's data, 0 if it is the RSTn due
    next after a non-empty interval, -1 otherwise."""
    if (code & 0xF8) != 0xD0:
        return 1
    if code != 0xD0 + found % 8 or p - previous - 2 <= 0:
        return -1
    return 0


@njit(nogil=True, cache=True)
def _entropy_data(d, words, start):  # pragma: no cover - compiled
    """A scan's entropy-coded data from ``start``: ``(end, restarts, last)``, ``end`` the offset
    of the first marker that is not RSTn (``ASK_PYTHON``: none, or an RSTn out of sequence or
    with no data before it), ``last`` the last RSTn's offset (``start - 2`` if none).

    ``words``: ``d``'s whole 8-byte words. Nearly every 0xFF in the data is a stuffed 0xFF00, so
    a block of words is looked into only where a byte is 0xFF not followed by 0x00
    (``_marker_bytes``, OR-ed over the block in one pass without branches)."""
    n = d.size
    found = 0
    previous = start - 2
    full = words.size - 1  # words with a word after them
    w = start >> 3
    while w < full:
        stop = min(w + _BLOCK, full)
        seen = np.uint64(0)
        for k in range(w, stop):
            seen |= _marker_bytes(words[k], words[k + 1])
        if seen:
            for k in range(w, stop):
                flags = _marker_bytes(words[k], words[k + 1])
                b = 0
                while flags:
                    if flags & np.uint64(0x80):
                        p = (k << 3) + b
                        code = d[p + 1]
                        if p >= start and code != 0xFF:  # 0xFF: fill before a marker
                            state = _restart(p, code, found, previous)
                            if state:
                                return (p if state > 0 else ASK_PYTHON), found, previous
                            previous = p
                            found += 1
                    flags >>= _BYTE
                    b += 1
        w = stop
    for p in range(max(start, max(full, 0) << 3), n - 1):  # the last bytes, one at a time
        code = d[p + 1]
        if d[p] == 0xFF and code != 0 and code != 0xFF:
            state = _restart(p, code, found, previous)
            if state:
                return (p if state > 0 else ASK_PYTHON), found, previous
            previous = p
            found += 1
    return ASK_PYTHON, found, previous


@njit(nogil=True, cache=True)
def whole_scans(d, max_scans):  # pragma: no cover - compiled
    """The scans of the JPEG ``d`` (uint8) when it is plainly whole, else ``ASK_PYTHON``.
    ``max_scans`` (-1: none): as ``walk_jpeg``'s, the count so far plus one once it is passed."""
    n = d.size
    words = d[: n // 8 * 8].view(np.uint64)  # its whole 8-byte words, for _entropy_data
    if n < 2 or d[0] != 0xFF or d[1] != 0xD8:
        return ASK_PYTHON
    # the frame: per component, its id, sampling and quantization table; which a scan coded
    ncomp = 0
    comp_id = np.zeros(MAX_COMPONENTS, np.int32)
    comp_h = np.zeros(MAX_COMPONENTS, np.int32)
    comp_v = np.zeros(MAX_COMPONENTS, np.int32)
    comp_q = np.zeros(MAX_COMPONENTS, np.int32)
    scanned = np.zeros(MAX_COMPONENTS, np.bool_)
    coef_bits = np.full((MAX_COMPONENTS, 64), -1, np.int32)
    dc = np.full(4, _UNDEFINED, np.int32)  # each Huffman table: _UNDEFINED, _FITS or _BAD
    ac = np.full(4, _UNDEFINED, np.int32)
    quant = np.zeros(4, np.bool_)
    width = height = 0
    hmax = vmax = 1
    progressive = False
    restart = 0
    scans = 0
    multiple_scans = False
    scan_comp = np.zeros(MAX_COMPS_IN_SCAN, np.int32)  # the frame index of each component a scan codes
    i = 2
    while True:
        if i + 1 >= n or d[i] != 0xFF or d[i + 1] == 0xFF:
            return ASK_PYTHON  # the end, fill bytes, or bytes that are no marker: the Python walk says
        marker = d[i + 1]
        i += 2
        if marker == 0xD9:  # EOI
            if scans == 0:
                return ASK_PYTHON
            for c in range(ncomp):
                if not scanned[c]:
                    return ASK_PYTHON
            return scans
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn outside a scan: ignored
            continue
        if marker == 0xD8 or i + 2 > n:
            return ASK_PYTHON
        length = (np.int64(d[i]) << 8) | d[i + 1]
        end = i + length
        if length < 2 or end > n:
            return ASK_PYTHON
        at = i + 2  # the segment's body: d[at:end]
        size = end - at
        if 0xE0 <= marker <= 0xEF or marker == 0xFE or marker == 0xDC:  # APPn, COM, DNL
            pass
        elif marker == 0xC4:  # DHT
            k = at
            while end - k > 16:
                index = d[k]
                count = 0
                for b in range(16):
                    count += d[k + 1 + b]
                fits = _codes_fit(d, k + 1)
                k += 17
                table = index & 0x0F
                if count > 256 or count > end - k or (index & 0xE0) != 0 or table >= 4:
                    return ASK_PYTHON
                if index & 0x10:
                    ac[table] = _FITS if fits else _BAD
                else:  # a DC symbol is a coefficient's bit count, at most 15
                    for s in range(count):
                        if d[k + s] > 15:
                            fits = False
                    dc[table] = _FITS if fits else _BAD
                k += count
            if k != end:
                return ASK_PYTHON
        elif marker == 0xDB:  # DQT
            k = at
            while k < end:
                pq = d[k] >> 4
                tq = d[k] & 0x0F
                k += 1
                if tq >= 4:
                    return ASK_PYTHON
                entries = 128 if pq else 64
                if end - k < entries:
                    return ASK_PYTHON
                k += entries
                quant[tq] = True
        elif marker == 0xC0 or marker == 0xC1 or marker == 0xC2:  # SOF: baseline, extended, progressive
            if ncomp or size < 6:
                return ASK_PYTHON
            precision = d[at]
            height = (np.int64(d[at + 1]) << 8) | d[at + 2]
            width = (np.int64(d[at + 3]) << 8) | d[at + 4]
            count = d[at + 5]
            if size != 6 + 3 * count or count < 1 or count > MAX_COMPONENTS:
                return ASK_PYTHON
            if precision != 8 and precision != 12:
                return ASK_PYTHON
            if height > MAX_SIDE or width > MAX_SIDE or height == 0 or width == 0:
                return ASK_PYTHON
            progressive = marker == 0xC2
            for c in range(count):
                p = at + 6 + 3 * c
                h = d[p + 1] >> 4
                v = d[p + 1] & 0x0F
                if h < 1 or h > 4 or v < 1 or v > 4:
                    return ASK_PYTHON
                for other in range(c):
                    if comp_id[other] == d[p]:
                        return ASK_PYTHON
                comp_id[c], comp_h[c], comp_v[c], comp_q[c] = d[p], h, v, d[p + 2]
                hmax = max(hmax, h)
                vmax = max(vmax, v)
            ncomp = count
        elif marker == 0xDA:  # SOS
            if ncomp == 0 or size < 1:
                return ASK_PYTHON
            count = d[at]
            if size != 4 + 2 * count or count < 1 or count > MAX_COMPS_IN_SCAN:
                return ASK_PYTHON
            if scans and not multiple_scans:
                return ASK_PYTHON
            for s in range(count):  # only the frame's first 4 components can be scanned, once each
                ident = d[at + 1 + 2 * s]
                found = -1
                for c in range(min(ncomp, MAX_COMPS_IN_SCAN)):
                    if comp_id[c] == ident:
                        found = c
                if found < 0:
                    return ASK_PYTHON
                for other in range(s):
                    if scan_comp[other] == found:
                        return ASK_PYTHON
                scan_comp[s] = found
            ss = d[at + 1 + 2 * count]
            se = d[at + 2 + 2 * count]
            ahl = d[at + 3 + 2 * count]
            ah = ahl >> 4
            al = ahl & 0x0F
            if scans == 0:
                multiple_scans = count < ncomp or progressive
            scans += 1
            if max_scans >= 0 and scans > max_scans:
                return scans
            for s in range(count):
                c = scan_comp[s]
                if not scanned[c] and (comp_q[c] >= 4 or not quant[comp_q[c]]):
                    return ASK_PYTHON
            if progressive:
                dc_band = ss == 0
                if dc_band:
                    bad = se != 0
                else:
                    bad = ss > se or se >= 64 or count != 1
                if (ah and al != ah - 1) or al > 13 or bad:
                    return ASK_PYTHON
                for s in range(count):
                    selector = d[at + 2 + 2 * s]
                    if dc_band and not ah:  # a first DC scan needs its DC table; AC scans their AC table
                        table_fits = (selector >> 4) < 4 and dc[selector >> 4] == _FITS
                    else:
                        table_fits = dc_band or ((selector & 0x0F) < 4 and ac[selector & 0x0F] == _FITS)
                    if not table_fits:
                        return ASK_PYTHON
                for s in range(count):
                    c = scan_comp[s]
                    if not dc_band and coef_bits[c, 0] < 0:
                        return ASK_PYTHON
                    lo, hi = 99, -99
                    for coef in range(ss, se + 1):
                        lo = min(lo, coef_bits[c, coef])
                        hi = max(hi, coef_bits[c, coef])
                    if (hi > 0) if not ah else not (lo == hi == ah):
                        return ASK_PYTHON
                    for coef in range(ss, se + 1):
                        coef_bits[c, coef] = al
            else:
                if ss or se != 63 or ahl:
                    return ASK_PYTHON  # libjpeg ignores them: the Python walk sends the file to OpenCV
                for s in range(count):
                    selector = d[at + 2 + 2 * s]
                    if (selector >> 4) >= 4 or (selector & 0x0F) >= 4 or dc[selector >> 4] != _FITS \
                            or ac[selector & 0x0F] != _FITS:
                        return ASK_PYTHON
            if count > 1:
                blocks = 0
                for s in range(count):
                    blocks += comp_h[scan_comp[s]] * comp_v[scan_comp[s]]
                if blocks > MAX_BLOCKS_IN_MCU:
                    return ASK_PYTHON
            for s in range(count):
                scanned[scan_comp[s]] = True
            if count == 1:
                c = scan_comp[0]
                mcus = -(-width * comp_h[c] // (hmax * 8)) * -(-height * comp_v[c] // (vmax * 8))
            else:
                mcus = -(-width // (hmax * 8)) * -(-height // (vmax * 8))
            # the entropy-coded data: to the first marker that is not RSTn; RSTn in sequence, none
            # empty, as many as the restart interval needs (an extra one after the last interval
            # allowed, as libjpeg reads past it)
            start = end
            data_end, found, previous = _entropy_data(d, words, start)
            if data_end < 0:
                return ASK_PYTHON
            tail = data_end - previous - 2  # the bytes after the last RSTn (or the scan's, if none)
            if found == 0:
                if restart and mcus > restart:
                    return ASK_PYTHON
                if data_end <= start:
                    return ASK_PYTHON
            else:
                if not restart:
                    return ASK_PYTHON
                needed = -(-mcus // restart) - 1
                if found == needed + 1 and tail <= 0:
                    pass  # an RST after the last interval: libjpeg reads past it
                elif found != needed or tail <= 0:
                    return ASK_PYTHON
            i = data_end
            continue
        elif marker == 0xDD:  # DRI
            if length != 4:
                return ASK_PYTHON
            restart = (np.int64(d[at]) << 8) | d[at + 1]
        else:  # other frames (lossless, arithmetic, hierarchical), DAC, unknown markers
            return ASK_PYTHON
        i = end
