"""``bench``: the benchmark's own argparse options, passed through untouched (so its --help is
its own)."""

from __future__ import annotations

import typer


def bench(ctx: typer.Context) -> None:
    """Benchmark Ultralytics and yolopipe side by side.

    The same model and images in one run, one JSON of rows (yolopipe bench --help lists its
    options).
    """
    from app.benchmark.cli import main as run_bench

    run_bench(list(ctx.args), prog="yolopipe bench")
