"""``yolopipe``: export, calibrate, build-engine, serve, predict, bench.

This module only builds the app from the commands' modules: ``build`` (export, calibrate,
build-engine), ``serve``, ``predict`` and ``bench``. Every command turns a ``YolopipeError`` into
one red line (plus a hint) and an exit status from ``terminal.ExitCode``; no user mistake prints
a traceback.
"""

from __future__ import annotations

from typing import Annotated

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

    faulthandler.enable()  # a crash in native code (a GPU library) prints where it happened
    cli()
