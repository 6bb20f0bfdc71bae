"""``python -m app.benchmark [options]``: the benchmark without the Typer CLI (the GPU machine
runs it this way). The options are ``BenchOptions``' fields, with their help texts."""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import MISSING, fields
from pathlib import Path

from app.benchmark.options import BenchOptions


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog,
                                description="Ultralytics vs yolopipe on the same model and images, in one run.")
    for f in fields(BenchOptions):
        flag, help_ = f"--{f.name.replace('_', '-')}", f.metadata["help"]
        if f.type in ("bool",):
            p.add_argument(flag, action="store_true", help=help_)
        elif f.name in ("batches", "pipelined_batches"):
            p.add_argument(flag, type=lambda s: tuple(int(x) for x in s.split(",") if x.strip()), help=help_)
        elif f.name in ("decoders", "skip"):
            p.add_argument(flag, type=lambda s: tuple(x.strip() for x in s.split(",") if x.strip()), help=help_)
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type), Path)
            p.add_argument(flag, type=kind, choices=f.metadata.get("choices"), help=help_)
        default = f.default if f.default is not MISSING else None
        p.set_defaults(**{f.name: default})
    return p


def main(argv: list[str] | None = None, prog: str = "python -m app.benchmark") -> int:
    from rich.console import Console

    from app.benchmark.run import run_benchmark

    args = _parser(prog).parse_args(argv)
    options = BenchOptions(**{f.name: getattr(args, f.name) for f in fields(BenchOptions)})
    console = Console(stderr=True, width=max(120, Console().width))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        run_benchmark(options, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
