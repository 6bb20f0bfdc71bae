"""The files a source names: a folder (recursive), one file, or a glob pattern, and the name
each is written under (its path relative to the source).

A folder of 10,000 images is listed before its first batch can start, holding the GIL the
GPU pipeline's threads need, so names are built as strings from ``os.scandir`` (no ``Path``
and no ``stat`` per file).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import NamedTuple

from app.errors import InvalidParameter
from app.imaging.headers import IMAGE_SUFFIXES


class SourceImage(NamedTuple):
    file: str  # the file's path as given or found (a ``Path`` works too)
    name: str  # path relative to SOURCE, as written in the output

    @property
    def path(self) -> Path:
        return Path(self.file)


def list_images(source: str, suffixes: frozenset[str] = IMAGE_SUFFIXES) -> list[SourceImage]:
    """Files with these suffixes (images by default) of a folder (recursive), a single file, or a
    glob pattern, sorted."""
    src = Path(source).expanduser()
    if src.is_dir():
        return _walk(src, suffixes)
    if src.is_file():
        return [SourceImage(str(src), src.name)]
    matches = sorted(Path(p) for p in glob.glob(str(src), recursive=True))
    files = [p for p in matches if p.is_file() and p.suffix.lower() in suffixes]
    if not files:
        raise InvalidParameter(f"no images found at {source!r} (a folder, an image file, or a glob pattern)")
    root = _glob_root(src)
    return [SourceImage(str(p), _relative(p, root)) for p in files]


def _walk(root: Path, suffixes: frozenset[str]) -> list[SourceImage]:
    """A folder's files with these suffixes, recursively, in the order of their relative names.

    What ``os.walk`` + ``os.path.isfile`` found (symlinked files in, symlinked folders not
    entered, unreadable folders left out), with ``os.scandir``'s file types instead of a
    ``stat`` per file, and names built as strings (pathlib's ``rglob`` + ``relative_to`` held
    the GIL many times longer, and the GPU waits for the listing before its first batch).
    """
    found: list[tuple[str, str]] = []
    folders = [(str(root), "")]
    while folders:
        folder, prefix = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if _is_folder(entry):
                        folders.append((entry.path, f"{prefix}{entry.name}/"))
                    elif _suffix(entry.name) in suffixes and _is_file(entry):
                        found.append((prefix + entry.name, entry.path))
        except OSError:
            continue
    # rglob's sorted order, by path components: the same as by the names with "/" as the lowest
    # character ("\0", in no file name), and without a list per name
    found.sort(key=lambda f: f[0].replace("/", "\0"))
    return [SourceImage(full, rel) for rel, full in found]


def _suffix(name: str) -> str:
    """``os.path.splitext(name)[1].lower()`` of a file name, in two string operations for most
    names (``splitext`` was the listing's biggest cost): none unless a character other than a
    dot comes before the last dot."""
    dot = name.rfind(".")
    if dot > 0 and (name[dot - 1] != "." or name[:dot].lstrip(".")):
        return name[dot:].lower()
    return ""


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()  # follows a symlink, like os.path.isfile
    except OSError:
        return False


def _glob_root(pattern: Path) -> Path:
    """The leading folders of a glob pattern that hold no wildcard: names are relative to it."""
    root = Path(pattern.anchor)
    for part in pattern.parts[len(pattern.parts[:1]) if pattern.anchor else 0 :]:
        if glob.has_magic(part):
            break
        root = root / part
    return root


def _relative(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()
