"""``predict``'s terminal output beside its JSON lines: the progress bar, the start-up report, and
``--video-decode`` checked before any work. Imported by ``predict`` when it runs."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.markup import escape

from app.cli.terminal import console
from app.errors import YolopipeError
from app.types import StartupSteps, process_age_s


class StartupReport:
    """``predict``'s start-up: the spinner names each step as it begins (and what is being built,
    and how far, on a first run); with ``--verbose`` every step is printed with its time, once,
    when the first results are written."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.steps = StartupSteps()
        before = process_age_s()  # the interpreter and the imports, before this command ran
        if before is not None:
            self.steps.record("starting Python and importing yolopipe", before)
        self._opened_at = time.perf_counter()
        self._reported = False

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        with console.status("loading model…") as status:
            self.steps.listener = lambda text: status.update(escape(text))
            try:
                yield
            finally:
                self.steps.listener = None
                self._opened_at = time.perf_counter()

    def watch(self, on_progress: Callable[[int, int | None], None]) -> Callable[[int, int | None], None]:
        """``on_progress`` that also reports the start-up once the first results are written."""
        def progress(advance: int, total: int | None) -> None:
            on_progress(advance, total)
            if advance and not self._reported:
                self._reported = True
                self.steps.record("the first batch: read, decode, detect, write (on a GPU, its CUDA graph captured "
                                  "first)",
                                  time.perf_counter() - self._opened_at)
                if self.verbose:
                    self.print()
        return progress

    def print(self) -> None:
        total = process_age_s()
        console.print("start-up, step by step:", highlight=False)
        for line in self.steps.lines():
            console.print(f"  {escape(line)}", highlight=False)
        if total is not None:
            console.print(f"  {total:7.2f} s  from the process start to the first results", highlight=False)


def check_video_decode(detector: Any) -> None:
    """The detector's ``--video-decode``: one this backend cannot use fails now, before any work."""
    from app.predict.sources import video_decoder

    try:
        video_decoder(detector)
    except YolopipeError:
        detector.close()
        raise


@contextlib.contextmanager
def progress_bar() -> Iterator[Callable[[int, int | None], None]]:
    """A progress bar on stderr; yields its ``on_progress(advance, total)``: images and video
    frames done (total None: not known, shown as ?)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("predict"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("predict", total=None)
        yield lambda advance, total: progress.update(task, total=total, advance=advance)
