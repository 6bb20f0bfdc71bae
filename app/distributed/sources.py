"""Where the images come from: a local folder, file or glob, or a URI of a pyarrow filesystem.

Local sources are listed with ``app.files.list_images`` (so names are the same as
``yolopipe predict`` writes). A URI (``s3://bucket/prefix``, ``gs://...``, ``file:///data``)
goes through ``pyarrow.fs.FileSystem.from_uri``; a wildcard in its path is matched like a local
glob (``*`` within one folder, ``**`` across folders) against the files below the
wildcard-free prefix, and names are relative to that prefix, as for a local glob.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from app.errors import InvalidImage, InvalidParameter
from app.files import list_images
from app.imaging.headers import IMAGE_SUFFIXES


@dataclass(frozen=True)
class ImageSource:
    """The images of one SOURCE: ``(name, path)`` pairs, and the filesystem the paths are on."""

    filesystem: Any  # a pyarrow.fs.FileSystem; paths are that filesystem's paths
    items: list[tuple[str, str]]  # (name as written in the output, path to read), sorted by name
    local: bool  # a plain local path: only the driver's node is sure to see it


def is_uri(source: str) -> bool:
    return "://" in source


def open_source(source: str) -> ImageSource:
    """List ``source``; an empty or unknown source is an ``InvalidParameter``."""
    import pyarrow.fs as pafs

    if not is_uri(source):
        items = [(img.name, str(img.path.resolve())) for img in list_images(source)]
        return ImageSource(pafs.LocalFileSystem(), items, local=True)
    uri, pattern = source, None
    magic = min((i for i in (source.find(c) for c in "*?[") if i >= 0), default=-1)
    if magic >= 0:  # list below the wildcard-free folder, match the rest of the path
        cut = source.rfind("/", 0, magic)
        uri, pattern = source[:cut], source[cut + 1 :]
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
        items = _list(fs, root.rstrip("/") or "/", pattern)
    except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise InvalidParameter(f"cannot list {source!r}: {exc}") from exc
    if not items:
        raise InvalidParameter(f"no images found at {source!r} (a folder, an image file, or a glob pattern)")
    return ImageSource(fs, items, local=False)


def _list(fs: Any, root: str, pattern: str | None) -> list[tuple[str, str]]:
    import pyarrow.fs as pafs

    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File and pattern is None:
        return [(info.base_name, info.path)] if _is_image(info.path) else []
    if info.type != pafs.FileType.Directory:
        return []
    match = re.compile(_glob_regex(pattern)).fullmatch if pattern is not None else None
    items = []
    for entry in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        if entry.type != pafs.FileType.File or not _is_image(entry.path):
            continue
        name = entry.path[len(root) :].lstrip("/")
        if match is None or match(name):
            items.append((name, entry.path))
    return sorted(items)


def _glob_regex(pattern: str) -> str:
    """A glob (``*``, ``?``, ``[...]`` within one folder; ``**`` for any folders) as a regex."""
    out = []
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if part == "**":
            out.append(".*" if i == len(parts) - 1 else "(?:[^/]+/)*")
            continue
        seg, j = "", 0
        while j < len(part):
            c = part[j]
            close = part.find("]", j + 2) if c == "[" else -1
            if c == "*":
                seg += "[^/]*"
            elif c == "?":
                seg += "[^/]"
            elif close > 0:
                body = part[j + 1 : close]
                seg += "[" + ("^" + body[1:] if body.startswith("!") else body) + "]"
                j = close
            else:
                seg += re.escape(c)
            j += 1
        out.append(seg + ("/" if i < len(parts) - 1 else ""))
    return "".join(out)


def _is_image(path: str) -> bool:
    dot = path.rfind(".")
    return dot >= 0 and path[dot:].lower() in IMAGE_SUFFIXES


def read_bytes(filesystem: Any, path: str) -> bytes | InvalidImage:
    """One file's bytes, or the error its output line will carry (same words as ``predict``)."""
    try:
        with filesystem.open_input_stream(path) as fh:
            return fh.read()
    except OSError as exc:  # pyarrow puts its own words in strerror; the errno's are predict's
        return InvalidImage(f"cannot read file: {os.strerror(exc.errno) if exc.errno else exc}")
