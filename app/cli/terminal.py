"""What every command shows on the terminal: the console, and a ``YolopipeError`` as one red line
(plus a hint) with its exit status from ``ExitCode``; no user mistake prints a traceback."""

from __future__ import annotations

import functools
import os
import traceback
from enum import IntEnum

import typer
from rich.console import Console
from rich.markup import escape

from app.errors import AccuracyGateFailed, BackendUnavailable, DeviceError, EngineMismatch, YolopipeError


class ExitCode(IntEnum):
    OK = 0
    INCOMPLETE = 1  # it ran, but some inputs failed or the accuracy gate refused the result
    USAGE = 2  # a bad option, path, weights file, image folder or parameter (Click's own usage errors too)
    UNAVAILABLE = 3  # a GPU, TensorRT or a built engine this command needs is missing or unusable here
    INTERNAL = 4  # a bug in yolopipe: YOLOPIPE_DEBUG=1 prints the traceback to report
    INTERRUPTED = 130  # Ctrl-C


EXIT_CODES_HELP = (
    "Exit status: 0 success · 1 finished, but some inputs failed or the INT8 accuracy gate refused the model · "
    "2 bad option, path, weights or parameter · 3 a GPU, TensorRT or engine this needs is missing here · "
    "4 internal error (YOLOPIPE_DEBUG=1 shows the traceback) · 130 interrupted."
)

console = Console(stderr=True, soft_wrap=True)  # paths and messages stay whole, for people and for grep


def counted(n: int, noun: str) -> str:
    """``1 image``, ``0 images``, ``2 errors``: a count and its noun, plural unless the count is one."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def exit_code_for(exc: YolopipeError) -> ExitCode:
    if isinstance(exc, (BackendUnavailable, EngineMismatch, DeviceError)):
        return ExitCode.UNAVAILABLE
    if isinstance(exc, AccuracyGateFailed):
        return ExitCode.INCOMPLETE
    return ExitCode.USAGE


def friendly(fn):
    """Map the error family to one line and an exit status (the table is ``ExitCode``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        os.environ.setdefault("YOLO_VERBOSE", "False")  # keep Ultralytics' banners out of our output
        try:
            return fn(*args, **kwargs)
        except YolopipeError as exc:
            console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
            if exc.hint:  # hints hold things like pip extras in [brackets]: not rich markup
                console.print(f"[yellow]hint:[/] {escape(exc.hint)}", highlight=False)
            raise typer.Exit(exit_code_for(exc)) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]")
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug: one line for the user, the traceback on request
            if os.environ.get("YOLOPIPE_DEBUG"):
                traceback.print_exc()
            console.print(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc)[:300])}",
                          highlight=False)
            console.print("[yellow]hint:[/] YOLOPIPE_DEBUG=1 prints the traceback; please report it", highlight=False)
            raise typer.Exit(ExitCode.INTERNAL) from None

    return wrapper
