"""``yolopipe``: export, calibrate, build-engine, serve, predict, bench.

This module only builds the app from the commands' modules: ``build`` (export, calibrate,
build-engine), ``serve``, ``predict`` and ``bench``. Every command turns a ``YolopipeError`` into
one red line (plus a hint) and an exit status from ``terminal.ExitCode``; no user mistake prints
a traceback.
"""

from __future__ import annotations

from typing import Annotated, NoReturn

import typer

from app.cli.bench import bench
from app.cli.build import build_engine, calibrate, export
from app.cli.options import Command
from app.cli.predict import predict
from app.cli.serve import serve
from app.cli.terminal import EXIT_CODES_HELP, friendly

cli = typer.Typer(
    name="yolopipe",
    help="Serve Ultralytics YOLOv8 detection at GPU speed: export → INT8 calibrate → TensorRT engine → "
    "HTTP service or folder inference, with detections equal to Ultralytics' own.",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help is plain text, shown as written: rich markup would eat "[ray]" and "[default: ...]",
    # and Typer's rich panels give flags a "<bool>" value they do not take.
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"yolopipe {version('yolopipe')}")
        raise typer.Exit()


@cli.callback()
def main_options(
    version: Annotated[bool | None, typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    pass


# In the order `yolopipe --help` lists them: the build steps, then the run steps.
cli.command(cls=Command)(friendly(export))
cli.command(cls=Command)(friendly(calibrate))
cli.command("build-engine", cls=Command)(friendly(build_engine))
cli.command(cls=Command)(friendly(serve))
cli.command(cls=Command)(friendly(predict))
# bench parses its own options (argparse): Click passes them on untouched, --help included.
cli.command(cls=Command, add_help_option=False,
            context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(friendly(bench))


def main() -> None:
    import faulthandler

    from app.bytecode import keep_bytecode

    faulthandler.enable()  # a crash in native code (a GPU library) prints where it happened
    keep_bytecode()  # before any command imports torch
    try:
        cli()
    except SystemExit as done:
        exit_now(done.code)
    exit_now(0)


def exit_now(code: object) -> NoReturn:
    """End the process with ``code`` (``SystemExit``'s: None is 0, a message is printed and 1)
    once the command is done, without the interpreter's finalization where a GPU library is
    loaded and no other thread is still working.

    Why: after a GPU run, the interpreter's teardown (the finalizers of torch, Numba,
    nvImageCodec and their CUDA state) kept a finished ``predict`` alive for over a second after
    its last line (H100 profiles, 2026-12-06): time a user waits for nothing, since the OS and
    the driver free a process's memory at exit either way. Everything yolopipe opened is closed
    by then, and the exit handlers still run (logging's flush, temporary folders)."""
    import atexit
    import os
    import sys
    import threading

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if "torch" not in sys.modules or others:
        sys.exit(status)  # the interpreter's own ending: it waits for those threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing more to write
            pass
    os._exit(status)
