"""``yolopipe predict``'s progress bar counts a video's frames: its total is the frame count the
container reports (after ``--vid-stride`` and ``--resume``), and it advances frame by frame."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from app.cli.terminal import ExitCode
from app.predict.video import frames_to_read
from tests.videos import write_clip

CLI = [sys.executable, "-m", "app.cli"]
FRAMES = 12


@pytest.fixture(scope="module")
def clip(tmp_path_factory, assets_dir):
    return write_clip(tmp_path_factory.mktemp("clip") / "clip.avi", assets_dir, count=FRAMES)


def test_frames_to_read_follows_the_stride_and_the_resume_point(clip, tmp_path):
    assert frames_to_read(clip) == FRAMES
    assert frames_to_read(clip, vid_stride=5) == 3  # frames 0, 5, 10
    assert frames_to_read(clip, start=4) == 8
    assert frames_to_read(clip, vid_stride=5, start=1) == 2  # frames 5, 10
    assert frames_to_read(clip, start=FRAMES) == 0
    broken = tmp_path / "broken.avi"
    broken.write_bytes(b"not a video")
    assert frames_to_read(broken) == 0  # nothing opens it: the run gives it one error line, no frames


@pytest.fixture(scope="module")
def detector(artifacts_dir):
    from app.contracts import RunShape
    from app.runtime import OpenOptions, open_detector

    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=4))
    with open_detector(options) as det:
        yield det


@pytest.fixture(scope="module")
def media(clip, tmp_path_factory, assets_dir):
    """A photo and the clip."""
    import shutil

    folder = tmp_path_factory.mktemp("media")
    shutil.copy(assets_dir / "bus.jpg", folder / "bus.jpg")
    shutil.copy(clip, folder / "clip.avi")
    return folder


def progress_of(detector, media, out) -> list[tuple[int, int | None]]:
    """Every ``on_progress(advance, total)`` call of a run over ``media``."""
    from app.predict.folder import predict_folder

    calls = []
    summary = predict_folder(detector, str(media), out, detector.params(),
                             on_progress=lambda advance, total: calls.append((advance, total)))
    assert summary.images == 1 + FRAMES
    return calls


def test_a_folder_reports_its_images_then_each_frame(detector, media, tmp_path):
    calls = progress_of(detector, media, tmp_path / "p.jsonl")
    assert calls[0] == (0, 1 + FRAMES) and {total for _, total in calls} == {1 + FRAMES}
    assert [advance for advance, _ in calls[1:]] == [1, 4, 4, 4]  # the image, then the frames batch by batch


def test_a_count_the_container_gets_wrong_is_set_right_when_the_video_ends(detector, media, tmp_path, monkeypatch):
    import app.predict.folder

    monkeypatch.setattr(app.predict.folder, "frames_to_read", lambda *args, **kwargs: FRAMES - 2)
    calls = progress_of(detector, media, tmp_path / "p.jsonl")
    assert calls[0] == (0, FRAMES - 1) and calls[-1] == (0, FRAMES + 1)
    assert sum(advance for advance, _ in calls) == FRAMES + 1
    monkeypatch.setattr(app.predict.folder, "frames_to_read", lambda *args, **kwargs: None)  # the container does not say
    calls = progress_of(detector, media, tmp_path / "p.jsonl")
    assert {total for _, total in calls} == {None} and sum(advance for advance, _ in calls) == FRAMES + 1


def run_predict(*args, cwd):
    proc = subprocess.run([*CLI, "predict", *args, "--backend", "onnxruntime"], check=False, capture_output=True,
                          text=True, cwd=cwd, timeout=600)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def shown_counts(stderr: str) -> list[str]:
    """The n/N column of the progress bar (its last state: stderr is not a terminal here)."""
    return re.findall(r"\b(\d+/(?:\d+|\?))\b", stderr)


def test_the_bar_counts_a_videos_frames(clip, tmp_path, artifacts_dir):
    out = tmp_path / "p.jsonl"
    proc = run_predict(str(clip), "--out", str(out), "--artifacts-dir", str(artifacts_dir), cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert shown_counts(proc.stderr) == [f"{FRAMES}/{FRAMES}"], proc.stderr  # was 0/0
    assert len(out.read_text().splitlines()) == FRAMES

    proc = run_predict(str(clip), "--out", str(out), "--artifacts-dir", str(artifacts_dir), "--vid-stride", "5",
                       cwd=tmp_path)
    assert proc.returncode == ExitCode.OK and shown_counts(proc.stderr) == ["3/3"], proc.stderr


def test_the_summary_says_1_image_and_1_error(capsys):
    """One image that failed: "1 image, 0 detections, 1 error", not "1 images, ... 1 errors"."""
    from pathlib import Path

    import typer

    from app.cli.predict import print_summary
    from app.predict.folder import FolderSummary

    with pytest.raises(typer.Exit) as info:
        print_summary(FolderSummary(images=1, videos=1, errors=1, error_files=["a.jpg: not an image"]), Path("out.jsonl"))
    assert info.value.exit_code == ExitCode.INCOMPLETE
    assert "1 image (frames of 1 video included), 0 detections, 1 error → out.jsonl" in capsys.readouterr().err
