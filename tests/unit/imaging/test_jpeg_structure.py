"""The JPEG structure walk against OpenCV (libjpeg-turbo) on a corpus of broken files: cut at
400 B, 2,000 B, every 1 % and more; bit flips in the scan data; header bytes changed; Huffman
and quantization tables removed, moved, over-subscribed; empty scans; restart intervals without
their markers, markers removed, doubled, out of order; progressive and CMYK files cut short;
garbage between segments and after the EOI; ... of ten source photos (baseline, progressive,
restart intervals, gray, 4:4:4, CMYK, optimized tables).

The policy, for every decode path: a JPEG is refused when OpenCV refuses it, and when its byte
structure shows a defect libjpeg only warns about. What the walk cannot see (corruption inside
the Huffman-coded data with every marker in place) decodes as libjpeg decodes it, on every path.
"""

from __future__ import annotations

from collections import Counter

import cv2
import numpy as np
import pytest

from app.errors import YolopipeError
from app.gpu.decoded import route
from app.imaging.check import check_image
from app.imaging.decode import decode_image
from app.imaging.headers import read_header
from app.imaging.jpeg_structure import _codes_fit, walk_jpeg

CPU_ERROR = "cannot decode this JPEG image (truncated or corrupt)"


def _opencv(data: bytes, capfd) -> tuple[bool, str]:
    """Whether OpenCV decodes ``data``, and what libjpeg printed (its warnings go to stderr)."""
    capfd.readouterr()
    try:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        decoded = img is not None and img.size > 0
    except cv2.error:
        decoded = False
    return decoded, capfd.readouterr().err.strip()


def _refusal(data: bytes) -> str | None:
    """The walk's verdict through the one header parser: a defect, or the header refused."""
    try:
        jpeg = read_header(data).jpeg
    except YolopipeError as exc:
        return f"header: {exc}"
    return jpeg.defect


def test_the_walk_refuses_what_opencv_refuses_and_what_libjpeg_warns_about_as_structure(corpus, capfd):
    seen: Counter = Counter()
    missed, overreached = [], []
    for name, data in corpus.items():
        decoded, warned = _opencv(data, capfd)
        refused = _refusal(data)
        seen[("opencv decodes" if decoded else "opencv refuses", "warns" if warned else "",
              "walk refuses" if refused else "walk passes")] += 1
        if not decoded and refused is None:
            missed.append(name)  # OpenCV refuses it and the walk would hand it to a GPU decoder
        if decoded and refused is not None and not warned:
            overreached.append((name, refused))  # a file libjpeg decodes cleanly, refused
    print(f"\n{len(corpus)} files:", dict(seen))
    assert not missed, missed
    assert not overreached, overreached
    assert len(corpus) > 1500
    # every class is there: agreed refusals, policy refusals (libjpeg's structural warnings),
    # files decoded cleanly, and entropy-level corruption both paths decode with a warning
    assert seen["opencv refuses", "", "walk refuses"] > 1000
    assert seen["opencv decodes", "warns", "walk refuses"] >= 30
    assert seen["opencv decodes", "", "walk passes"] >= 100
    assert seen["opencv decodes", "warns", "walk passes"] >= 100


def test_the_gpu_routing_refuses_exactly_what_the_cpu_path_refuses(corpus):
    """For every file: the CPU path (``decode_image``) and the GPU path's routing (``route``,
    which hands a GPU decoder only what it takes) give the same error; what reaches a GPU
    decoder is a file the CPU path decodes."""
    for name, data in corpus.items():
        try:
            decode_image(data)
            cpu = None
        except YolopipeError as exc:
            cpu = str(exc)
        gpu, host = route([data], [None])
        if gpu:
            assert cpu is None, (name, cpu)
            assert check_image(data).jpeg.gpu_decodable
        else:
            answer = host[0]
            assert (str(answer) if isinstance(answer, YolopipeError) else None) == cpu, name


def test_cut_files_of_the_issue_are_opencvs_own_error(sources):
    bus = sources["bus"]
    for cut in (bus[:400], bus[:2000], bus[: len(bus) // 2], bus[: len(bus) * 9 // 10], bus[:-2]):
        with pytest.raises(YolopipeError, match=r"^cannot decode this JPEG image \(truncated or corrupt\)$"):
            decode_image(cut)
        assert read_header(cut).jpeg.defect is not None


@pytest.mark.parametrize("name, defect", [
    ("bus_cut_half", "the data ends before the EOI marker"),
    ("bus_cut_after_sos", "the data ends before the EOI marker"),
    ("bus_zero_length_scan", "scan 1 has no entropy-coded data"),
    ("bus_eoi_only_after_header", "no scan before the EOI marker"),
    ("bus_dri_without_rst", "no restart markers in scan 1, where its 3468 MCUs need 866"),
    ("restarts_rst_out_of_order", "restart markers out of sequence in scan 1"),
    ("restarts_rst_removed", "restart markers out of sequence in scan 1"),
    ("restarts_no_dri", "restart markers in scan 1 without a restart interval"),
    ("progressive_last_scan_repeated", "an inconsistent progression for component 1"),
    ("bus_garbage_between_segments", "bytes that are not a marker at offset"),
    ("bus_dht_0_oversubscribed", "a bad DC Huffman table 0"),
    ("bus_no_dqt", "no quantization table 0 for component 1"),
    ("bus_dqt_16_bit_short", "a DQT segment shorter than its tables"),
    ("bus_hierarchical_sof", "a hierarchical JPEG"),
    ("bus_second_soi", "a second SOI marker"),
])
def test_each_rule_names_its_defect(corpus, name, defect):
    assert walk_jpeg(corpus[name]).defect.startswith(defect)


def test_what_libjpeg_reads_leniently_goes_to_opencv_on_every_path(corpus, sources):
    """A JPEG without Huffman tables (Motion-JPEG frames: libjpeg takes the standard ones) or
    with its scan parameters zeroed is whole, decoded by OpenCV, never by a GPU decoder."""
    for name in ("opencv_no_dht", "bus_no_dht", "bus_sos_parameters_zeroed"):
        header = read_header(corpus[name]).jpeg
        assert header.defect is None and header.needs_libjpeg and not header.gpu_decodable, name
        gpu, host = route([corpus[name]], [None])
        assert not gpu and isinstance(host[0], np.ndarray)
        np.testing.assert_array_equal(host[0], decode_image(corpus[name]))
    # coded with the standard tables, it decodes to the same pixels without them
    np.testing.assert_array_equal(decode_image(corpus["opencv_no_dht"]), decode_image(sources["opencv"]))
    assert not read_header(sources["opencv"]).jpeg.needs_libjpeg


def test_what_follows_the_eoi_is_ignored_as_libjpeg_ignores_it(corpus, sources):
    assert walk_jpeg(corpus["bus_trailing_garbage"]).defect is None
    np.testing.assert_array_equal(decode_image(corpus["bus_trailing_garbage"]), decode_image(sources["bus"]))


def _libjpeg_codes_fit(bits: bytes) -> bool:
    """jdhuff.c's ``jpeg_make_d_derived_tbl`` (Figures C.1 and C.2): the codes, length by length,
    must each fit their length without being all ones."""
    huffsize = [length for length, count in enumerate(bits, 1) for _ in range(count)] + [0]
    code, si, p = 0, huffsize[0], 0
    while huffsize[p]:
        while huffsize[p] == si:
            p += 1
            code += 1
        if code >= 1 << si:
            return False
        code <<= 1
        si += 1
    return True


def test_the_huffman_table_check_is_libjpegs(sources, forge):
    tables = []
    for data in sources.values():  # every table of the photos, as they define them
        for at, _, end in (s for s in forge.jpeg_segments(data) if s[1] == 0xC4):
            k = at + 4
            while end - k > 16:
                tables.append(data[k + 1 : k + 17])
                k += 17 + sum(data[k + 1 : k + 17])
    rng = np.random.default_rng(0)
    for _ in range(20_000):  # random lengths, near full code spaces, over-subscribed by one code
        bits = rng.integers(0, 4, 16) * (rng.random(16) < 0.6)
        last = int(rng.integers(1, 17))
        bits[last:] = 0
        room = (1 << last) - 1 - sum(int(c) << (last - 1 - j) for j, c in enumerate(bits[: last - 1]))
        bits[last - 1] = min(255, max(0, room + int(rng.integers(-1, 2))))
        tables.append(bytes(bits.astype(np.uint8)))
    verdicts = Counter(_libjpeg_codes_fit(bits) for bits in tables)
    assert all(_codes_fit(bits) == _libjpeg_codes_fit(bits) for bits in tables)
    assert verdicts[True] > 1000 and verdicts[False] > 1000



def _with_fill_and_markers_between_segments(forge, data: bytes) -> bytes:
    """0xFF fill bytes before each header marker, and an RSTn and a TEM (which libjpeg skips
    outside a scan) after each header segment."""
    segments = forge.jpeg_segments(data)
    out = data[:2]
    for at, marker, end in segments:
        out += b"\xff\xff\xff" + data[at:end] + (b"\xff\xd3\xff\x01" if marker != 0xDA else b"")
    return out + data[segments[-1][2] :]


def test_the_walks_rarer_paths_against_opencv(sources, forge, capfd):
    """Fill bytes and markers libjpeg skips, a component id twice in the frame, an MCU of too many
    blocks, an AC scan before its DC scan, an empty restart interval, an RSTn after the last
    interval: the walk's verdict, and OpenCV's decode (or refusal, or warning) that it answers to."""
    bus, progressive, restarts = sources["bus"], sources["progressive"], sources["restarts"]
    sof = forge.jpeg_sof(bus)
    twice, blocks = bytearray(bus), bytearray(bus)
    twice[sof + 13] = bus[sof + 10]  # the second component takes the first one's id
    for c in range(3):
        blocks[sof + 11 + 3 * c] = 0x44  # 4x4 sampling: 48 blocks an MCU
    first_scan = forge.jpeg_segments(progressive)[-1][0]  # dropped with its data; the tables after it stay
    rsts = [(at, code) for at, code in forge.jpeg_markers(restarts) if 0xD0 <= code <= 0xD7]
    after_last = 0xD0 + (rsts[-1][1] - 0xD0 + 1) % 8
    cases = {  # name: (the file, the walk's defect; None: OpenCV decodes it cleanly, to the source's pixels)
        "fill and skipped markers": (_with_fill_and_markers_between_segments(forge, bus), None),
        "fill and skipped markers, progressive": (_with_fill_and_markers_between_segments(forge, progressive), None),
        "an RSTn after the last interval": (restarts[:-2] + bytes([0xFF, after_last]) + restarts[-2:], None),
        "a component id twice": (bytes(twice), "component id 1 twice in the frame"),
        "an MCU of 48 blocks": (bytes(blocks), "an MCU of 48 blocks"),
        "an AC scan first": (progressive[:first_scan] + progressive[forge.jpeg_markers(progressive)[0][0] :],
                             "an AC scan of component 1 before its DC scan"),
        "an empty restart interval": (restarts[: rsts[3][0] + 2] + restarts[rsts[4][0] :],
                                      "scan 1 has an empty restart interval"),
    }
    source = {"fill and skipped markers": bus, "fill and skipped markers, progressive": progressive,
              "an RSTn after the last interval": restarts}
    for name, (data, defect) in cases.items():
        decoded, warned = _opencv(data, capfd)
        assert walk_jpeg(data).defect == defect, name
        if defect is None:
            assert decoded and not warned, name
            np.testing.assert_array_equal(decode_image(data), decode_image(source[name]))
            assert read_header(data) == read_header(source[name]), name
        else:
            assert not decoded or warned, name
