"""The INT8 models and their report are installed together: all of a calibration's files or none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.artifacts import int8 as artifacts
from app.artifacts.int8 import (
    INSTALL_JOURNAL_NAME,
    discard_staged,
    install_int8,
    int8_cpu_model_path,
    int8_qdq_model_path,
    int8_report_path,
    staged_path,
)

NAMES = ("model.int8.onnx", "model.int8-cpu.onnx", "int8_report.json")


def finals(d: Path) -> list[Path]:
    return [d / name for name in NAMES]


def stage(d: Path, tag: str) -> None:
    for f in finals(d):
        staged_path(f).write_text(tag)


def contents(d: Path) -> list[str | None]:
    return [f.read_text() if f.is_file() else None for f in finals(d)]


def test_install_moves_every_staged_file_and_leaves_no_journal(tmp_path):
    stage(tmp_path, "new")
    install_int8(tmp_path, finals(tmp_path))
    assert contents(tmp_path) == ["new"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NAMES)


def test_killed_after_the_commit_the_next_reader_finishes_the_install(tmp_path, monkeypatch):
    stage(tmp_path, "old")
    install_int8(tmp_path, finals(tmp_path))
    stage(tmp_path, "new")
    moved = []

    def die_after_one_move(model_dir):  # the process dies after its first rename
        src, dst = json.loads((Path(model_dir) / INSTALL_JOURNAL_NAME).read_text())["moves"][0]
        (Path(model_dir) / src).replace(Path(model_dir) / dst)
        moved.append(dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts, "finish_install", die_after_one_move)
    with pytest.raises(KeyboardInterrupt):
        install_int8(tmp_path, finals(tmp_path))
    monkeypatch.undo()
    assert moved == ["model.int8.onnx"] and contents(tmp_path) == ["new", "old", "old"]  # half-way on disk
    # Every reader's path finishes the committed install first: it never sees the mix.
    for path_of in (int8_cpu_model_path, int8_qdq_model_path, int8_report_path):
        assert path_of(tmp_path).is_file()
        assert contents(tmp_path) == ["new"] * 3
    assert not (tmp_path / INSTALL_JOURNAL_NAME).exists()


def test_killed_before_the_commit_nothing_changes_and_the_leftovers_go(tmp_path):
    stage(tmp_path, "old")
    install_int8(tmp_path, finals(tmp_path))
    stage(tmp_path, "new")  # staged, never committed (the process died here)
    assert contents(tmp_path) == ["old"] * 3
    assert int8_cpu_model_path(tmp_path).read_text() == "old"
    discard_staged(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NAMES)
    assert contents(tmp_path) == ["old"] * 3


def test_a_fresh_folder_has_no_model_until_the_commit(tmp_path):
    stage(tmp_path, "new")
    with pytest.raises(Exception, match="no INT8 model"):
        int8_cpu_model_path(tmp_path)
