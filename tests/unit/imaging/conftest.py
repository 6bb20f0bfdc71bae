"""The imaging tests' JPEG corpus: ten source photos of every kind a JPEG walk meets (baseline,
progressive, restart intervals, gray, 4:4:4, CMYK, optimized and standard tables) and every
broken variant of each (``tests/forge.py``'s ``jpeg_broken``)."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image


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
