"""What the commands print: counts with their nouns in the singular for one, the plural otherwise."""

from __future__ import annotations

from app.cli.terminal import counted


def test_a_count_of_one_is_singular_and_any_other_plural():
    assert [counted(n, "image") for n in (0, 1, 2, 1000)] == ["0 images", "1 image", "2 images", "1000 images"]
    assert counted(1, "error") == "1 error" and counted(3, "detection") == "3 detections"
