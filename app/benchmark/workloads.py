"""What the benchmark (and the decoder tests) feed the detectors.

* ``load_images``: the JPEGs of a folder, or Ultralytics' bus.jpg/zidane.jpg plus resized and
  flipped variants when no folder is given;
* ``varied_jpegs``: JPEGs generated to cover what a decoder can get wrong: sizes 160–1920 px,
  baseline and progressive, every chroma subsampling (4:4:4, 4:2:2, 4:2:0, 4:1:1, 4:4:0),
  grayscale, CMYK, and every EXIF orientation;
* ``make_folder``: a folder of N JPEGs (copies of the given ones) for the folder benchmark.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

JpegList = list[tuple[str, bytes]]

# (name, OpenCV encode flags or a special kind): each variant is made at two sizes per source.
_SUBSAMPLING = {"444": "IMWRITE_JPEG_SAMPLING_FACTOR_444", "422": "IMWRITE_JPEG_SAMPLING_FACTOR_422",
                "420": "IMWRITE_JPEG_SAMPLING_FACTOR_420", "411": "IMWRITE_JPEG_SAMPLING_FACTOR_411",
                "440": "IMWRITE_JPEG_SAMPLING_FACTOR_440"}
VARIANTS = (
    "420", "444", "422", "411", "440", "progressive-420", "progressive-444", "gray", "gray-progressive", "cmyk",
    "exif-2", "exif-3", "exif-4", "exif-5", "exif-6", "exif-7", "exif-8",
)
SIZES = (160, 320, 480, 640, 800, 1024, 1280, 1600, 1920)


def sample_sources() -> list[np.ndarray]:
    """Ultralytics' own bus.jpg and zidane.jpg as BGR frames (in every Ultralytics install)."""
    import cv2
    import ultralytics

    assets = Path(ultralytics.__file__).parent / "assets"
    return [cv2.imread(str(assets / name), cv2.IMREAD_COLOR) for name in ("bus.jpg", "zidane.jpg")]


def fit(img: np.ndarray, side: int) -> np.ndarray:
    """``img`` resized so its longer side is ``side`` (INTER_AREA when shrinking)."""
    import cv2

    h, w = img.shape[:2]
    r = side / max(h, w)
    interp = cv2.INTER_AREA if r < 1 else cv2.INTER_LINEAR
    return cv2.resize(img, (max(1, round(w * r)), max(1, round(h * r))), interpolation=interp)


def load_images(images_dir: Path | None) -> JpegList:
    """``(name, JPEG bytes)``: the folder's JPEGs, else Ultralytics' assets + generated variants."""

    if images_dir is not None:
        files = sorted(p for p in Path(images_dir).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
        if not files:
            from app.errors import InvalidParameter

            raise InvalidParameter(f"no JPEG images in {images_dir}")
        return [(p.name, p.read_bytes()) for p in files]
    out: JpegList = []
    for name, img in zip(("bus", "zidane"), sample_sources()):
        out.append((f"{name}.jpg", encode(img)))
        for tag, variant in (("640", fit(img, 640)), ("480-flip", fit(img[:, ::-1], 480)), ("1280", fit(img, 1280))):
            out.append((f"{name}-{tag}.jpg", encode(np.ascontiguousarray(variant))))
    return out


def encode(img: np.ndarray, quality: int = 90, **flags: int) -> bytes:
    """OpenCV (libjpeg-turbo) JPEG encoding; ``flags``: ``IMWRITE_*`` names → values."""
    import cv2

    params = [cv2.IMWRITE_JPEG_QUALITY, quality]
    for name, value in flags.items():
        params += [getattr(cv2, name), value]
    ok, buf = cv2.imencode(".jpg", img, params)
    if not ok:
        raise RuntimeError(f"OpenCV could not encode a JPEG with {flags}")
    return buf.tobytes()


def with_exif_orientation(jpeg: bytes, orientation: int) -> bytes:
    """Insert an APP1 EXIF segment holding only the orientation tag right after SOI."""
    tiff = b"II*\x00" + (8).to_bytes(4, "little") + (1).to_bytes(2, "little")
    tiff += (0x0112).to_bytes(2, "little") + (3).to_bytes(2, "little") + (1).to_bytes(4, "little")
    tiff += orientation.to_bytes(2, "little") + b"\x00\x00" + (0).to_bytes(4, "little")
    payload = b"Exif\x00\x00" + tiff
    app1 = b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload
    return jpeg[:2] + app1 + jpeg[2:]


def encode_variant(img: np.ndarray, variant: str, quality: int = 90) -> bytes:
    """``img`` (BGR) as a JPEG of the named ``variant`` (one of ``VARIANTS``)."""
    import cv2

    if variant in _SUBSAMPLING:
        return encode(img, quality, IMWRITE_JPEG_SAMPLING_FACTOR=getattr(cv2, _SUBSAMPLING[variant]))
    if variant.startswith("progressive-"):
        sub = _SUBSAMPLING[variant.split("-", 1)[1]]
        return encode(img, quality, IMWRITE_JPEG_PROGRESSIVE=1, IMWRITE_JPEG_SAMPLING_FACTOR=getattr(cv2, sub))
    if variant.startswith("gray"):
        gray = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
        return encode(gray, quality, **({"IMWRITE_JPEG_PROGRESSIVE": 1} if "progressive" in variant else {}))
    if variant == "cmyk":  # OpenCV cannot write CMYK; Pillow writes an Adobe CMYK JPEG
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(img[..., ::-1])).convert("CMYK").save(buf, "JPEG", quality=quality)
        return buf.getvalue()
    if variant.startswith("exif-"):
        return with_exif_orientation(encode(img, quality), int(variant.split("-", 1)[1]))
    raise ValueError(f"unknown JPEG variant {variant!r}")


def varied_jpegs(sources: Sequence[np.ndarray] | None = None, per_variant: int = 2) -> JpegList:
    """Every variant of ``VARIANTS`` from every source at ``per_variant`` sizes (160–1920 px)."""
    sources = list(sources) if sources is not None else sample_sources()
    out: JpegList = []
    k = 0
    for s, src in enumerate(sources):
        for variant in VARIANTS:
            for _ in range(per_variant):
                side = SIZES[k % len(SIZES)]
                k += 1
                out.append((f"src{s}-{variant}-{side}.jpg", encode_variant(fit(src, side), variant, 85 + k % 11)))
    return out


def make_folder(folder: Path, images: JpegList, count: int) -> Path:
    """``count`` JPEGs in ``folder`` (copies of ``images``, round robin); reused when already there."""
    folder.mkdir(parents=True, exist_ok=True)
    existing = sorted(folder.glob("*.jpg"))
    if len(existing) == count:
        return folder
    for p in existing:
        p.unlink()
    for i in range(count):
        name, data = images[i % len(images)]
        (folder / f"{i:06d}-{Path(name).stem}.jpg").write_bytes(data)
    return folder
