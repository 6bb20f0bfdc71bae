"""Sources of a distributed job: local paths as ``predict`` lists them, and pyarrow-filesystem URIs."""

from __future__ import annotations

import pytest

from app.distributed.sources import open_source, read_bytes
from app.errors import InvalidParameter
from app.predict.folder import SourceImage, _read, list_images


@pytest.fixture()
def tree(tmp_path):
    root = tmp_path / "photos"
    (root / "sub").mkdir(parents=True)
    for rel in ("a.jpg", "b.PNG", "sub/c.jpeg", "sub/d.jpg"):
        (root / rel).write_bytes(rel.encode())
    (root / "notes.txt").write_text("not an image")
    return root


def test_local_sources_are_named_like_predict(tree):
    for source in (str(tree), str(tree / "sub" / "c.jpeg"), str(tree / "**" / "*.jpg")):
        src = open_source(source)
        assert src.local
        assert [name for name, _ in src.items] == [img.name for img in list_images(source)]
        assert [src.filesystem.open_input_stream(p).read() for _, p in src.items] == [
            img.path.read_bytes() for img in list_images(source)
        ]


def test_file_uri_folder_file_and_glob(tree):
    src = open_source(tree.as_uri())
    assert not src.local
    assert [name for name, _ in src.items] == ["a.jpg", "b.PNG", "sub/c.jpeg", "sub/d.jpg"]
    assert read_bytes(src.filesystem, src.items[2][1]) == b"sub/c.jpeg"
    assert [n for n, _ in open_source((tree / "sub" / "d.jpg").as_uri()).items] == ["d.jpg"]
    # globs: named relative to the wildcard-free folder, matched as a local glob matches
    for pattern in ("sub/*.jpg", "*.jp*g", "**/*.jp*g", "s?b/[a-c].*", "**/*"):
        assert [n for n, _ in open_source(tree.as_uri() + "/" + pattern).items] == [
            img.name for img in list_images(str(tree / pattern))
        ], pattern


def test_empty_or_missing_sources_are_clear_errors(tree, tmp_path):
    with pytest.raises(InvalidParameter, match="no images"):
        open_source((tmp_path / "missing").as_uri())
    with pytest.raises(InvalidParameter, match="no images"):
        open_source(tree.as_uri() + "/*.gif")
    with pytest.raises(InvalidParameter):
        open_source("nosuchscheme://bucket/x")


def test_unreadable_file_gives_predicts_error_line(tree):
    src = open_source(str(tree))
    missing = tree / "gone.jpg"
    got = read_bytes(src.filesystem, str(missing))
    assert str(got) == str(_read(SourceImage(missing, "gone.jpg")))
