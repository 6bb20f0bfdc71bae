"""The oldest web stack that .ci/run tests the HTTP suites on is the one pyproject allows: each
direct dependency pinned in .ci/oldest.txt has that version as its lower bound, so neither can
move without the other."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = Version(version)
    return pins


def _lower_bounds() -> dict[str, Version]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {}
    for text in project["dependencies"]:
        requirement = Requirement(text)
        lows = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
        if lows:
            bounds[requirement.name.lower()] = max(lows)
    return bounds


def test_each_pinned_direct_dependency_is_its_lower_bound():
    pins, bounds = _pins(), _lower_bounds()
    direct = {name: version for name, version in pins.items() if name in bounds}
    assert {"fastapi", "starlette", "uvicorn", "python-multipart", "httptools", "pydantic"} <= set(direct)
    assert {name: bounds[name] for name in direct} == direct


def test_the_pins_are_allowed_by_every_other_bound():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    for text in project["dependencies"]:
        requirement = Requirement(text)
        if requirement.name.lower() in pins:
            assert requirement.specifier.contains(pins[requirement.name.lower()]), text
