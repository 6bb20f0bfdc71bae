"""Is a JPEG's byte structure whole? One walk over its markers and entropy-coded data, before any
pixel is decoded, on every decode path (OpenCV's and the GPU decoders').

Why here and not in a decoder: OpenCV (libjpeg-turbo) reports what it cannot decode, but nvJPEG's
hardware decoder reports nothing per image (it enqueues the batch and calls every image a
success), so a JPEG cut short decoded "successfully" into a staging slot that still held another
image. The bytes decide it instead, the same way for every decoder.

The rule (``walk_jpeg`` returns the first defect it finds, or None):

* what libjpeg refuses, OpenCV included: data that ends before an EOI marker (OpenCV reads from
  memory with a suspending source, so a file cut anywhere, even just before its EOI, is an
  error there, never libjpeg's "premature end" warning); no scan before the EOI; a second SOI or
  SOF; an unknown marker; a segment shorter than its fields; a second scan where the first
  coded every component; a scan naming a component the frame lacks (or twice), a Huffman
  table that is neither defined nor one of libjpeg's standard ones (tables 0 and 1; in a
  progressive JPEG, none), an over-subscribed Huffman table, a quantization table never
  defined; progressive parameters libjpeg calls invalid; an interleaved MCU of more than 10
  blocks; sampling factors outside 1-4; a side over 65,500; a hierarchical frame; samples of
  other than 8 or 12 bits (2-16 when lossless);
* what libjpeg decodes with a warning, that the byte structure shows (the policy, for OpenCV
  and the GPU alike): a scan (or a restart interval) with no entropy-coded data; restart
  markers out of sequence, or not as many as the restart interval and the scan's MCUs need;
  restart markers without a restart interval; bytes that are not a marker between segments;
  an inconsistent progression (an AC scan before its DC scan, a refinement of bits never
  sent); a frame component no scan codes.

Not visible here, and so decoded as libjpeg decodes them on both paths: corruption inside a
scan's Huffman-coded data that leaves every marker in place (a flipped bit; a scan cut short
with an EOI appended). Only a full Huffman decode sees those; libjpeg itself decodes them, with
a warning. The GPU pipeline fills each image's staging with zeros before decoding it, so what
a decoder leaves unwritten is never another image's pixels.

``needs_libjpeg``: a whole file that leans on a libjpeg leniency the GPU decoders need not
share (a Huffman table it never defines, for which libjpeg takes the standard one, as for
Motion-JPEG frames, which Ultralytics reads that way too; a sequential scan whose Ss/Se/Ah/Al
bytes are not 0/63/0/0, which libjpeg ignores): OpenCV decodes it on every path, so every path
answers alike (with the standard tables, a file coded with others decodes to noise there).

The walk reads segment headers in Python (a few dozen) and finds the markers inside the
entropy-coded data with NumPy (``app.imaging.jpeg_markers``): no Python loop per byte. Every
image is walked on a thread that holds the GIL the GPU pipeline needs, so each step counts: a
segment's body is copied only when it is read, a Huffman table is checked in one pass as it is
defined (its verdict counts when a scan uses it), and a scan checks each table selector once.
"""

from __future__ import annotations

import logging
import operator
import struct
import threading
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from app.imaging.jpeg_markers import (
    MAX_BLOCKS_IN_MCU,
    MAX_COMPONENTS,
    MAX_COMPS_IN_SCAN,
    MAX_SIDE,
    RST0,
    Markers,
    find_markers,
)

log = logging.getLogger(__name__)

SOI, EOI, SOS, DHT, DQT, DRI, DNL, DAC = 0xD8, 0xD9, 0xDA, 0xC4, 0xDB, 0xDD, 0xDC, 0xCC
_SOF = frozenset(range(0xC0, 0xD0)) - {DHT, 0xC8, DAC}
_SOF_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_SOF_LOSSLESS = frozenset({0xC3, 0xC7, 0xCB, 0xCF})
_SOF_ARITHMETIC = frozenset({0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_SOF_HIERARCHICAL = frozenset({0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF})
_SKIPPED = frozenset({DNL, 0xFE, *range(0xE0, 0xF0)})  # DNL, COM, APPn: read past by their length
_WITHOUT_LENGTH = frozenset({SOI, EOI, 0x01, *range(RST0, RST0 + 8)})  # TEM, RSTn


@dataclass(frozen=True)
class JpegStructure:
    """What the walk found: the first defect (None: the structure is whole), whether only libjpeg
    should decode the file, and how many scans it walked."""

    defect: str | None = None
    needs_libjpeg: bool = False
    scans: int = 0


class _Defect(Exception):
    pass


def walk_jpeg(data: bytes, *, max_scans: int | None = None) -> JpegStructure:
    """Walk ``data`` (a JPEG whose header ``app.imaging.headers`` read) from SOI to EOI.

    ``max_scans``: stop after that many scans (the caller refuses more anyway) and report the
    count so far plus one, with no defect. After ``use_compiled_walk``, a plainly whole JPEG is
    walked without the GIL (``app.imaging.jpeg_whole``); the rest here, which names defects."""
    compiled = _compiled_walk
    if compiled is not None:
        scans = compiled(_read_only(data), -1 if max_scans is None else max_scans)
        if scans >= 0:  # else ASK_PYTHON
            return JpegStructure(None, False, scans)
    return walk_jpeg_python(data, max_scans=max_scans)


_compiled_walk = None  # jpeg_whole.whole_scans, once use_compiled_walk has loaded it
_loading = threading.Lock()  # one load at a time: a second caller waits for the first one's


def use_compiled_walk(*, wait: bool = True) -> threading.Thread | None:
    """Walk plainly whole JPEGs compiled from now on. Loading it holds the GIL about 0.7 s (5 s
    where it is not cached yet), and it saved an H100 host's folder loop about 85 µs an image:
    only runs of enough images call it (``app.predict.folder``); nothing else imports Numba.

    ``wait=False``: loaded on a thread of its own (returned; None when loaded already), beside
    what the caller does next; the walks stay in Python until it is loaded, with the same
    answers. Not a daemon: a process that ends while Numba compiles waits for it, rather than
    tearing LLVM down under it."""
    if _compiled_walk is not None:
        return None
    if not wait:
        loader = threading.Thread(target=use_compiled_walk, name="jpeg-walk-load")
        loader.start()
        return loader
    with _loading:
        if _compiled_walk is None:
            _load_compiled_walk()
    return None


def _load_compiled_walk() -> None:
    global _compiled_walk
    try:
        from app.imaging import jpeg_whole

        jpeg_whole.whole_scans(_read_only(bytes(2)), -1)  # loaded (or compiled) now, for what the walks pass
    except Exception as exc:  # noqa: BLE001 - e.g. nowhere to cache it: the Python walk stays
        log.info("JPEG walk: the compiled walk is not available (%s: %s)", type(exc).__name__, exc)
        return
    _compiled_walk = jpeg_whole.whole_scans


def _read_only(data: bytes) -> np.ndarray:
    """``data``'s bytes as the compiled walk takes them, a read-only array whatever holds them:
    Numba compiles a writable array apart (warmed on one, the first walk compiled again)."""
    view = np.frombuffer(data, np.uint8)
    view.flags.writeable = False
    return view


def walk_jpeg_python(data: bytes, *, max_scans: int | None = None) -> JpegStructure:
    """``walk_jpeg`` in Python alone."""
    walker = _Walker(data, max_scans)
    try:
        walker.run()
    except _Defect as exc:
        return JpegStructure(str(exc), walker.needs_libjpeg, walker.scans)
    except (IndexError, struct.error):
        return JpegStructure("the data ends inside a segment", walker.needs_libjpeg, walker.scans)
    return JpegStructure(None, walker.needs_libjpeg, walker.scans)


class _Walker:
    # what no segment has set yet: class defaults, not set for every walk
    needs_libjpeg = False
    scans = 0
    progressive = lossless = arithmetic = False  # the frame's coding process (SOFn)
    width = height = 0
    hmax = vmax = 1
    restart = 0
    multiple_scans = False
    _markers: Markers | None = None  # see _markers_from
    _base = 0

    def __init__(self, data: bytes, max_scans: int | None) -> None:
        self.data = data if isinstance(data, bytes) else bytes(data)
        self.max_scans = max_scans
        # the frame's components: id → (h, v, quantization table), in order; those a scan may name
        # (libjpeg: the first 4); those a scan coded; progressive: the last Al sent per coefficient
        self.components: dict[int, tuple[int, int, int]] = {}
        self.scannable: dict[int, tuple[int, int, int]] = {}
        self.scanned: set[int] = set()
        self.coef_bits: dict[int, list[int]] = {}
        # Huffman table id → whether libjpeg takes the table: it checks one when a scan uses it
        self.dc: dict[int, bool] = {}
        self.ac: dict[int, bool] = {}
        self.quant: set[int] = set()

    # ------------------------------------------------------------------ the marker walk
    def run(self) -> None:
        d, n = self.data, len(self.data)
        if d[:2] != b"\xff\xd8":
            raise _Defect("no SOI marker")
        i = 2
        while True:
            if i + 1 < n and d[i] == 0xFF and d[i + 1] != 0xFF:  # the usual: no fill bytes
                marker = d[i + 1]
                i += 2
            else:
                if i >= n:
                    raise _Defect("the data ends before the EOI marker")
                if d[i] != 0xFF:
                    raise _Defect(f"bytes that are not a marker at offset {i}")
                i += 1
                while i < n and d[i] == 0xFF:  # fill bytes
                    i += 1
                if i >= n:
                    raise _Defect("the data ends before the EOI marker")
                marker = d[i]
                i += 1
            if marker in _WITHOUT_LENGTH:
                if marker == EOI:
                    self._end()
                    return
                if marker == SOI:
                    raise _Defect("a second SOI marker")
                continue  # RSTn, TEM: outside a scan libjpeg ignores them
            if i + 2 > n:
                raise _Defect("the data ends inside a segment")
            length = d[i] << 8 | d[i + 1]
            if length < 2:
                raise _Defect(f"a segment of length {length}")
            end = i + length
            if end > n:
                raise _Defect("the data ends inside a segment")
            if marker in _SKIPPED:  # APPn, COM, DNL: their bodies are not read (nor copied)
                pass
            elif marker == DHT:
                self._huffman(d[i + 2 : end])
            elif marker == DQT:
                self._quantization(d[i + 2 : end])
            elif marker in _SOF:
                self._frame(marker, d[i + 2 : end])
            elif marker == SOS:
                i = self._scan(d[i + 2 : end], end)
                if self.max_scans is not None and self.scans > self.max_scans:
                    return
                continue
            elif marker == DRI:
                if length != 4:
                    raise _Defect("a DRI segment that is not 4 bytes long")
                self.restart = d[i + 2] << 8 | d[i + 3]
            elif marker != DAC:
                raise _Defect(f"an unknown marker 0xFF{marker:02X}")
            i = end

    def _end(self) -> None:
        if not self.scans:
            raise _Defect("no scan before the EOI marker")
        if len(self.scanned) < len(self.components):  # scans code frame components only
            missing = [ident for ident in self.components if ident not in self.scanned]
            raise _Defect(f"no scan codes component {missing[0]}")

    # ------------------------------------------------------------------ segments
    def _frame(self, marker: int, body: bytes) -> None:
        if self.components:
            raise _Defect("a second SOF marker")
        if marker in _SOF_HIERARCHICAL:
            raise _Defect("a hierarchical JPEG (libjpeg decodes none)")
        precision, height, width, count = struct.unpack_from(">BHHB", body)
        if len(body) != 6 + 3 * count or not 1 <= count <= MAX_COMPONENTS:
            raise _Defect("an SOF segment whose length does not match its components")
        lossless = marker in _SOF_LOSSLESS
        if not (2 <= precision <= 16 if lossless else precision in (8, 12)):
            raise _Defect(f"{precision}-bit samples")
        if height > MAX_SIDE or width > MAX_SIDE or not height or not width:
            raise _Defect(f"a frame of {width} x {height} (libjpeg's limit is {MAX_SIDE})")
        self.width, self.height = width, height
        self.progressive, self.lossless, self.arithmetic = (
            marker in _SOF_PROGRESSIVE, lossless, marker in _SOF_ARITHMETIC)
        components, scannable = self.components, self.scannable
        hmax = vmax = 1
        for at in range(6, 6 + 3 * count, 3):
            ident, hv = body[at], body[at + 1]
            h, v = hv >> 4, hv & 0x0F
            if not (1 <= h <= 4 and 1 <= v <= 4):
                raise _Defect(f"sampling factors {h}x{v}")
            if ident in components:
                raise _Defect(f"component id {ident} twice in the frame")
            components[ident] = component = (h, v, body[at + 2])
            if len(scannable) < MAX_COMPS_IN_SCAN:
                scannable[ident] = component
            hmax, vmax = max(hmax, h), max(vmax, v)
        self.hmax, self.vmax = hmax, vmax

    def _huffman(self, body: bytes) -> None:
        k, n = 0, len(body)
        while n - k > 16:
            index = body[k]
            bits = body[k + 1 : k + 17]
            count = sum(bits)
            k += 17
            if count > 256 or count > n - k:
                raise _Defect("a DHT segment with more codes than it holds")
            table = index & 0x0F
            if index & ~0x1F or table >= 4:
                raise _Defect(f"a Huffman table index 0x{index:02X}")
            if index & 0x10:
                self.ac[table] = _codes_fit(bits)
            else:  # a DC symbol is a coefficient's bit count, at most 15
                self.dc[table] = _codes_fit(bits) and (not count or max(body[k : k + count]) <= 15)
            k += count
        if k != n:
            raise _Defect("a DHT segment whose length does not match its tables")

    def _quantization(self, body: bytes) -> None:
        k, n = 0, len(body)
        while k < n:
            pq, tq = body[k] >> 4, body[k] & 0x0F
            k += 1
            if tq >= 4:
                raise _Defect(f"a quantization table index {tq}")
            size = 128 if pq else 64  # 16-bit entries, or 8-bit ones
            if n - k < size:
                raise _Defect("a DQT segment shorter than its tables")
            k += size
            self.quant.add(tq)

    # ------------------------------------------------------------------ scans
    def _scan(self, body: bytes, data_at: int) -> int:
        """Check one SOS and its entropy-coded data; returns where the next marker starts."""
        if not self.components:
            raise _Defect("a scan before the frame header")
        count = body[0] if body else 0
        if len(body) != 4 + 2 * count or not 1 <= count <= MAX_COMPS_IN_SCAN:
            raise _Defect("an SOS segment whose length does not match its components")
        if self.scans and not self.multiple_scans:
            raise _Defect("a second scan in a single-scan JPEG")
        # each component's id and table selector (DC table << 4 | AC table), and its (h, v, quantization)
        idents, selectors = body[1 : 1 + 2 * count : 2], body[2 : 2 + 2 * count : 2]
        comps: list[tuple[int, int, int]] = []
        for k, ident in enumerate(idents):
            comp = self.scannable.get(ident)
            if comp is None or ident in idents[:k]:
                raise _Defect(f"a scan of component {ident}, which the frame lacks or the scan repeats")
            comps.append(comp)
        ss, se, ahl = body[1 + 2 * count : 4 + 2 * count]
        ah, al = ahl >> 4, ahl & 0x0F
        if not self.scans:
            self.multiple_scans = count < len(self.components) or self.progressive
        self.scans += 1
        if self.max_scans is not None and self.scans > self.max_scans:
            return len(self.data)
        if not self.lossless:
            for ident, (_, _, quant) in zip(idents, comps):
                if ident not in self.scanned and quant not in self.quant:
                    raise _Defect(f"no quantization table {quant} for component {ident}")
        if self.progressive:
            self._progression(idents, selectors, ss, se, ah, al)
        elif not self.lossless:
            if ss or se != 63 or ahl:
                self.needs_libjpeg = True  # libjpeg warns and ignores them (files with zeros exist)
            if not self.arithmetic:
                dc, ac = self.dc, self.ac
                for selector in dict.fromkeys(selectors):  # a repeated one checks the same tables again
                    if not (dc.get(selector >> 4) and ac.get(selector & 0x0F)):  # the usual: both defined, both fit
                        self._table(dc, selector >> 4, "DC")
                        self._table(ac, selector & 0x0F, "AC")
        blocks = sum([h * v for h, v, _ in comps]) if count > 1 else 1
        if blocks > MAX_BLOCKS_IN_MCU:
            raise _Defect(f"an MCU of {blocks} blocks")
        self.scanned.update(idents)
        return self._entropy_data(data_at, self._mcus(comps))

    def _table(self, tables: dict[int, bool], index: int, kind: str) -> None:
        fits = tables.get(index)
        if fits is None:
            if index > 1 or self.progressive:
                raise _Defect(f"no {kind} Huffman table {index}")
            self.needs_libjpeg = True  # libjpeg takes its standard table (Motion-JPEG frames)
        elif not fits:
            raise _Defect(f"a bad {kind} Huffman table {index}")

    def _progression(self, idents: bytes, selectors: bytes, ss: int, se: int, ah: int, al: int) -> None:
        dc_band = ss == 0
        bad = (se != 0) if dc_band else (ss > se or se >= 64 or len(idents) != 1)
        if (ah and al != ah - 1) or al > 13 or bad:
            raise _Defect(f"invalid progressive parameters Ss={ss} Se={se} Ah={ah} Al={al}")
        if not self.arithmetic:
            for selector in selectors:
                if dc_band and not ah:
                    self._table(self.dc, selector >> 4, "DC")
                elif not dc_band:
                    self._table(self.ac, selector & 0x0F, "AC")
        for ident in idents:
            bits = self.coef_bits.setdefault(ident, [-1] * 64)
            if not dc_band and bits[0] < 0:
                raise _Defect(f"an AC scan of component {ident} before its DC scan")
            band = bits[ss : se + 1]  # each coefficient's bits so far: a refinement must follow them
            if max(band) > 0 if not ah else not min(band) == max(band) == ah:
                raise _Defect(f"an inconsistent progression for component {ident}")
            bits[ss : se + 1] = [al] * (se + 1 - ss)

    def _mcus(self, comps) -> int:
        if len(comps) == 1:
            h, v, _ = comps[0]
            across = -(-self.width * h // (self.hmax * 8))
            down = -(-self.height * v // (self.vmax * 8))
            return across * down
        return -(-self.width // (self.hmax * 8)) * -(-self.height // (self.vmax * 8))

    def _entropy_data(self, start: int, mcus: int) -> int:
        """The scan's data runs from ``start`` to the first marker that is not RSTn; RSTn must
        come in sequence, as many as the restart interval needs, none empty."""
        positions, codes, ends = self._markers_from(start)
        first = bisect_left(positions, start)
        k = bisect_left(ends, first)
        if k == len(ends):
            raise _Defect("the data ends before the EOI marker")
        last = ends[k]
        end, found = positions[last], last - first
        if not found:  # the usual scan: no restart markers
            if self.restart and not self.lossless and mcus > self.restart:
                raise _Defect(f"no restart markers in scan {self.scans}, where its {mcus} MCUs need "
                              f"{-(-mcus // self.restart) - 1}")
            if end <= start:
                raise _Defect(f"scan {self.scans} has no entropy-coded data")
            return end
        if not self.restart:
            raise _Defect(f"restart markers in scan {self.scans} without a restart interval")
        if np.any(np.asarray(codes[first:last]) != self._sequence(found)):
            raise _Defect(f"restart markers out of sequence in scan {self.scans}")
        at = np.asarray(positions[first:last])
        sizes = np.diff(np.concatenate(([start - 2], at, [end]))) - 2  # bytes per restart interval
        if not self.lossless:
            needed = -(-mcus // self.restart) - 1
            if found == needed + 1 and sizes[-1] <= 0:
                sizes = sizes[:-1]  # an RST after the last interval: libjpeg reads past it
            elif found != needed:
                raise _Defect(f"{found} restart markers in scan {self.scans}, where its {mcus} MCUs need {needed}")
        if np.any(sizes <= 0):
            raise _Defect(f"scan {self.scans} has an empty restart interval")
        return end

    def _sequence(self, count: int) -> np.ndarray:
        """RST0, RST1, ... RST7, RST0, ...: the codes ``count`` restart markers must have."""
        return (np.arange(count) % 8 + RST0).astype(np.uint8)

    def _markers_from(self, start: int) -> Markers:
        """The markers at or after ``start``, found once, from the first scan's data on."""
        if self._markers is None or start < self._base:
            self._markers, self._base = find_markers(self.data, start), start
        return self._markers


# What a code length adds to a Huffman table's Kraft sum, scaled by 2**16: a code of length L
# takes 2**(16 - L) of the 2**16 codes of 16 bits.
_CODE_SPACE = tuple(1 << (16 - length) for length in range(1, 17))


def _codes_fit(bits: bytes) -> bool:
    """libjpeg's check of a Huffman table (``jpeg_make_d_derived_tbl``): the code lengths leave
    room for every code, and no code is all ones. It counts the codes length by length and fails
    where they reach ``1 << length``; that count over ``1 << length`` only grows with the length,
    so it fails somewhere exactly when it fails at the last: when the codes fill all 2**16 of 16
    bits (Kraft's sum reaches 1), summed in one C-level pass."""
    return sum(map(operator.mul, bits, _CODE_SPACE)) < 1 << 16
