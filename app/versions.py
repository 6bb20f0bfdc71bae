"""Installed versions of named distributions, for the metadata artifacts and results record."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata


def package_versions(packages: Iterable[str]) -> dict[str, str]:
    """``{distribution: version}`` for those of ``packages`` that are installed."""
    out = {}
    for pkg in packages:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out
