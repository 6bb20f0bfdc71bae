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
entropy-coded data with NumPy over the bytes after the first scan (one comparison pass): no
Python loop per byte.
"""

from __future__ import annotations

import struct
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

SOI, EOI, SOS, DHT, DQT, DRI, DNL, DAC = 0xD8, 0xD9, 0xDA, 0xC4, 0xDB, 0xDD, 0xDC, 0xCC
RST0 = 0xD0
_SOF = frozenset(range(0xC0, 0xD0)) - {DHT, 0xC8, DAC}
_SOF_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_SOF_LOSSLESS = frozenset({0xC3, 0xC7, 0xCB, 0xCF})
_SOF_ARITHMETIC = frozenset({0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_SOF_HIERARCHICAL = frozenset({0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF})
_SKIPPED = frozenset({DNL, 0xFE, *range(0xE0, 0xF0)})  # DNL, COM, APPn: read past by their length
_MAX_SIDE = 65_500  # libjpeg's JPEG_MAX_DIMENSION
_MAX_BLOCKS_IN_MCU = 10  # libjpeg's D_MAX_BLOCKS_IN_MCU
_MAX_COMPONENTS = 10
_MAX_COMPS_IN_SCAN = 4


@dataclass(frozen=True)
class JpegStructure:
    """What the walk found: the first defect (None: the structure is whole), whether only libjpeg
    should decode the file, and how many scans it walked."""

    defect: str | None = None
    needs_libjpeg: bool = False
    scans: int = 0


class _Defect(Exception):
    pass


@dataclass
class _Component:
    ident: int
    h: int
    v: int
    quant: int
    coef_bits: list[int] | None = None  # progressive: the last Al sent per coefficient, -1 none yet
    scanned: bool = False


def walk_jpeg(data: bytes, *, max_scans: int | None = None) -> JpegStructure:
    """Walk ``data`` (a JPEG whose header ``app.imaging.headers`` read) from SOI to EOI.

    ``max_scans``: stop after that many scans (the caller refuses more anyway) and report the
    count so far plus one, with no defect."""
    walker = _Walker(data, max_scans)
    try:
        walker.run()
    except _Defect as exc:
        return JpegStructure(str(exc), walker.needs_libjpeg, walker.scans)
    except (IndexError, struct.error):
        return JpegStructure("the data ends inside a segment", walker.needs_libjpeg, walker.scans)
    return JpegStructure(None, walker.needs_libjpeg, walker.scans)


class _Walker:
    def __init__(self, data: bytes, max_scans: int | None) -> None:
        self.data = data if isinstance(data, bytes) else bytes(data)
        self.max_scans = max_scans
        self.needs_libjpeg = False
        self.scans = 0
        self.frame: list[_Component] = []
        self.sof = 0
        self.width = self.height = 0
        self.hmax = self.vmax = 1
        # Huffman table id → (code counts per length, symbols): libjpeg checks a table when a scan uses it
        self.dc: dict[int, tuple[bytes, bytes]] = {}
        self.ac: dict[int, tuple[bytes, bytes]] = {}
        self._checked: set[tuple[bytes, bytes]] = set()
        self.quant: set[int] = set()
        self.restart = 0
        self.multiple_scans = False
        self._markers: tuple[list[int], list[int]] | None = None  # see _markers_from
        self._positions = self._codes = np.zeros(0, np.uint8)
        self._base = 0

    # ------------------------------------------------------------------ the marker walk
    def run(self) -> None:
        d, n = self.data, len(self.data)
        if d[:2] != b"\xff\xd8":
            raise _Defect("no SOI marker")
        i = 2
        while True:
            if i >= n:
                raise _Defect("the data ends before the EOI marker")
            if d[i] != 0xFF:
                raise _Defect(f"bytes that are not a marker at offset {i}")
            while i < n and d[i] == 0xFF:  # fill bytes
                i += 1
            if i >= n:
                raise _Defect("the data ends before the EOI marker")
            marker = d[i]
            i += 1
            if marker == EOI:
                self._end()
                return
            if RST0 <= marker <= RST0 + 7 or marker == 0x01:  # outside a scan libjpeg ignores them
                continue
            if marker == SOI:
                raise _Defect("a second SOI marker")
            if i + 2 > n:
                raise _Defect("the data ends inside a segment")
            (length,) = struct.unpack_from(">H", d, i)
            if length < 2:
                raise _Defect(f"a segment of length {length}")
            if i + length > n:
                raise _Defect("the data ends inside a segment")
            body = d[i + 2 : i + length]
            if marker in _SOF:
                self._frame(marker, body)
            elif marker == DHT:
                self._huffman(body)
            elif marker == DQT:
                self._quantization(body)
            elif marker == DRI:
                if len(body) != 2:
                    raise _Defect("a DRI segment that is not 4 bytes long")
                (self.restart,) = struct.unpack(">H", body)
            elif marker == SOS:
                i = self._scan(body, i + length)
                if self.max_scans is not None and self.scans > self.max_scans:
                    return
                continue
            elif marker == DAC:
                pass
            elif marker not in _SKIPPED:
                raise _Defect(f"an unknown marker 0xFF{marker:02X}")
            i += length

    def _end(self) -> None:
        if not self.scans:
            raise _Defect("no scan before the EOI marker")
        missing = [c.ident for c in self.frame if not c.scanned]
        if missing:
            raise _Defect(f"no scan codes component {missing[0]}")

    # ------------------------------------------------------------------ segments
    def _frame(self, marker: int, body: bytes) -> None:
        if self.frame:
            raise _Defect("a second SOF marker")
        if marker in _SOF_HIERARCHICAL:
            raise _Defect("a hierarchical JPEG (libjpeg decodes none)")
        precision, height, width, count = struct.unpack_from(">BHHB", body)
        if len(body) != 6 + 3 * count or not 1 <= count <= _MAX_COMPONENTS:
            raise _Defect("an SOF segment whose length does not match its components")
        if not (2 <= precision <= 16 if marker in _SOF_LOSSLESS else precision in (8, 12)):
            raise _Defect(f"{precision}-bit samples")
        if height > _MAX_SIDE or width > _MAX_SIDE or not height or not width:
            raise _Defect(f"a frame of {width} x {height} (libjpeg's limit is {_MAX_SIDE})")
        self.sof, self.width, self.height = marker, width, height
        for c in range(count):
            ident, hv, quant = body[6 + 3 * c : 9 + 3 * c]
            h, v = hv >> 4, hv & 0x0F
            if not (1 <= h <= 4 and 1 <= v <= 4):
                raise _Defect(f"sampling factors {h}x{v}")
            if any(x.ident == ident for x in self.frame):
                raise _Defect(f"component id {ident} twice in the frame")
            self.frame.append(_Component(ident, h, v, quant))
        self.hmax = max(c.h for c in self.frame)
        self.vmax = max(c.v for c in self.frame)

    def _huffman(self, body: bytes) -> None:
        k, n = 0, len(body)
        while n - k > 16:
            index = body[k]
            bits = body[k + 1 : k + 17]
            count = sum(bits)
            k += 17
            if count > 256 or count > n - k:
                raise _Defect("a DHT segment with more codes than it holds")
            symbols = body[k : k + count]
            k += count
            table = index & 0x0F
            if index & ~0x1F or table >= 4:
                raise _Defect(f"a Huffman table index 0x{index:02X}")
            if index & 0x10:
                self.ac[table] = (bits, b"")
            else:
                self.dc[table] = (bits, symbols)
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
        if not self.frame:
            raise _Defect("a scan before the frame header")
        count = body[0] if body else 0
        if len(body) != 4 + 2 * count or not 1 <= count <= _MAX_COMPS_IN_SCAN:
            raise _Defect("an SOS segment whose length does not match its components")
        if self.scans and not self.multiple_scans:
            raise _Defect("a second scan in a single-scan JPEG")
        comps: list[tuple[_Component, int, int]] = []
        for k in range(count):
            ident, tables = body[1 + 2 * k], body[2 + 2 * k]
            comp = next((c for c in self.frame[:_MAX_COMPS_IN_SCAN] if c.ident == ident), None)
            if comp is None or any(c is comp for c, _, _ in comps):
                raise _Defect(f"a scan of component {ident}, which the frame lacks or the scan repeats")
            comps.append((comp, tables >> 4, tables & 0x0F))
        ss, se, ahl = body[1 + 2 * count : 4 + 2 * count]
        ah, al = ahl >> 4, ahl & 0x0F
        if not self.scans:
            self.multiple_scans = count < len(self.frame) or self.sof in _SOF_PROGRESSIVE
        self.scans += 1
        if self.max_scans is not None and self.scans > self.max_scans:
            return len(self.data)
        if self.sof not in _SOF_LOSSLESS:
            for comp, _, _ in comps:
                if not comp.scanned and comp.quant not in self.quant:
                    raise _Defect(f"no quantization table {comp.quant} for component {comp.ident}")
        if self.sof in _SOF_PROGRESSIVE:
            self._progression(comps, ss, se, ah, al)
        elif self.sof not in _SOF_LOSSLESS:
            if (ss, se, ah, al) != (0, 63, 0, 0):
                self.needs_libjpeg = True  # libjpeg warns and ignores them (files with zeros exist)
            if self.sof not in _SOF_ARITHMETIC:
                for _, dc, ac in comps:
                    self._table(self.dc, dc, "DC")
                    self._table(self.ac, ac, "AC")
        blocks = sum(c.h * c.v for c, _, _ in comps) if count > 1 else 1
        if blocks > _MAX_BLOCKS_IN_MCU:
            raise _Defect(f"an MCU of {blocks} blocks")
        for comp, _, _ in comps:
            comp.scanned = True
        return self._entropy_data(data_at, self._mcus(comps))

    def _table(self, tables: dict[int, tuple[bytes, bytes]], index: int, kind: str) -> None:
        table = tables.get(index)
        if table is None:
            if index > 1 or self.sof in _SOF_PROGRESSIVE:
                raise _Defect(f"no {kind} Huffman table {index}")
            self.needs_libjpeg = True  # libjpeg takes its standard table (Motion-JPEG frames)
            return
        if table in self._checked:
            return
        bits, symbols = table
        if not _codes_fit(bits) or (kind == "DC" and max(symbols, default=0) > 15):
            raise _Defect(f"a bad {kind} Huffman table {index}")
        self._checked.add(table)

    def _progression(self, comps, ss: int, se: int, ah: int, al: int) -> None:
        dc_band = ss == 0
        bad = (se != 0) if dc_band else (ss > se or se >= 64 or len(comps) != 1)
        if (ah and al != ah - 1) or al > 13 or bad:
            raise _Defect(f"invalid progressive parameters Ss={ss} Se={se} Ah={ah} Al={al}")
        if self.sof not in _SOF_ARITHMETIC:
            for _, dc, ac in comps:
                if dc_band and not ah:
                    self._table(self.dc, dc, "DC")
                elif not dc_band:
                    self._table(self.ac, ac, "AC")
        for comp, _, _ in comps:
            if comp.coef_bits is None:
                comp.coef_bits = [-1] * 64
            bits = comp.coef_bits
            if not dc_band and bits[0] < 0:
                raise _Defect(f"an AC scan of component {comp.ident} before its DC scan")
            band = bits[ss : se + 1]  # each coefficient's bits so far: a refinement must follow them
            if max(band) > 0 if not ah else not min(band) == max(band) == ah:
                raise _Defect(f"an inconsistent progression for component {comp.ident}")
            bits[ss : se + 1] = [al] * (se + 1 - ss)

    def _mcus(self, comps) -> int:
        if len(comps) == 1:
            c = comps[0][0]
            across = -(-self.width * c.h // (self.hmax * 8))
            down = -(-self.height * c.v // (self.vmax * 8))
            return across * down
        return -(-self.width // (self.hmax * 8)) * -(-self.height // (self.vmax * 8))

    def _entropy_data(self, start: int, mcus: int) -> int:
        """The scan's data runs from ``start`` to the first marker that is not RSTn; RSTn must
        come in sequence, as many as the restart interval needs, none empty."""
        positions, ends = self._markers_from(start)
        first = bisect_left(positions, start)
        k = bisect_left(ends, first)
        if k == len(ends):
            raise _Defect("the data ends before the EOI marker")
        last = ends[k]
        end, found = positions[last], last - first
        if not found:  # the usual scan: no restart markers
            if self.restart and self.sof not in _SOF_LOSSLESS and mcus > self.restart:
                raise _Defect(f"no restart markers in scan {self.scans}, where its {mcus} MCUs need "
                              f"{-(-mcus // self.restart) - 1}")
            if end <= start:
                raise _Defect(f"scan {self.scans} has no entropy-coded data")
            return end
        if not self.restart:
            raise _Defect(f"restart markers in scan {self.scans} without a restart interval")
        codes = self._codes[first:last]
        if np.any(codes != self._sequence(found)):
            raise _Defect(f"restart markers out of sequence in scan {self.scans}")
        at = self._positions[first:last]
        sizes = np.diff(np.concatenate(([start - 2], at, [end]))) - 2  # bytes per restart interval
        if self.sof not in _SOF_LOSSLESS:
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

    def _markers_from(self, start: int) -> tuple[list[int], list[int]]:
        """Every marker's 0xFF at or after ``start`` (found once, from the first scan's data on):
        an 0xFF followed by a byte that is neither 0x00 (a stuffed data byte) nor 0xFF (fill).
        Returns their offsets and the indices (into them) of the markers that are not RSTn."""
        if self._markers is None or start < self._base:
            arr = np.frombuffer(self.data, np.uint8)
            ff = np.flatnonzero(arr[start:-1] == 0xFF) + start
            nxt = arr[ff + 1]
            keep = (nxt != 0) & (nxt != 0xFF)
            self._positions, self._codes = ff[keep], nxt[keep]
            rst = (self._codes >= RST0) & (self._codes <= RST0 + 7)
            self._markers = (self._positions.tolist(), np.flatnonzero(~rst).tolist())
            self._base = start
        return self._markers


def _codes_fit(bits: bytes) -> bool:
    """libjpeg's check of a Huffman table: the code lengths leave room for every code, and no
    code is all ones."""
    code = 0
    for length, count in enumerate(bits.rstrip(b"\x00"), 1):
        code += count
        if code >= 1 << length:
            return False
        code <<= 1
    return True
