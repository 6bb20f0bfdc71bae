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

import io
from collections import Counter

import cv2
import numpy as np
import pytest
from PIL import Image

from app.errors import YolopipeError
from app.gpu.decoded import route
from app.imaging.check import check_image
from app.imaging.decode import decode_image
from app.imaging.headers import read_header
from app.imaging.jpeg_structure import walk_jpeg

CPU_ERROR = "cannot decode this JPEG image (truncated or corrupt)"


def _cv(img: np.ndarray, *params: int) -> bytes:
    return cv2.imencode(".jpg", img, list(params))[1].tobytes()


def _pil(img: Image.Image, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", **kw)
    return out.getvalue()


@pytest.fixture(scope="module")
def sources(assets_dir) -> dict[str, bytes]:
    bus = (assets_dir / "bus.jpg").read_bytes()
    small = cv2.resize(cv2.imdecode(np.frombuffer(bus, np.uint8), cv2.IMREAD_COLOR), (405, 540),
                       interpolation=cv2.INTER_AREA)
    rgb = Image.fromarray(np.ascontiguousarray(small[..., ::-1]))
    return {
        "bus": bus, "zidane": (assets_dir / "zidane.jpg").read_bytes(),  # the photos: 137 KB and 50 KB
        "opencv": _cv(small),  # libjpeg's standard Huffman tables, as Motion-JPEG frames use
        "progressive": _cv(small, cv2.IMWRITE_JPEG_PROGRESSIVE, 1),
        "restarts": _cv(small, cv2.IMWRITE_JPEG_RST_INTERVAL, 4),
        "gray": _cv(cv2.cvtColor(small, cv2.COLOR_BGR2GRAY)),
        "s444": _pil(rgb, subsampling=0, quality=90),
        "cmyk": _pil(rgb.convert("CMYK")),
        "cmyk_progressive": _pil(rgb.convert("CMYK"), progressive=True),
        "pil_progressive": _pil(rgb, progressive=True, quality=85),
        "optimized": _pil(rgb, optimize=True),
    }


@pytest.fixture(scope="module")
def corpus(sources, forge) -> dict[str, bytes]:
    out = dict(sources)
    for name, data in sources.items():
        out.update(forge.jpeg_broken(name, data))
    return out


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
