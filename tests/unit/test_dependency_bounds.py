"""The web stack's bounds are the versions the tests run on. The oldest that .ci/run tests the
HTTP suites on is the one pyproject allows: each direct dependency pinned in .ci/oldest.txt has
that version as its lower bound, so neither can move without the other. A library whose private
internals yolopipe subclasses is bounded above, at the newest minor release the test run (which
installs the newest versions pyproject allows) has passed on: a new minor release may rename what
the subclass reads."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# library → the module that subclasses its internals, and what it imports from them
PRIVATE = {"uvicorn": ("app/api/protocol.py", "from uvicorn.protocols.http.httptools_impl import")}


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


def _requirement(name: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return next(r for r in map(Requirement, project["dependencies"]) if r.name.lower() == name)


def test_the_subclassing_modules_are_the_ones_named():
    for module, imported in PRIVATE.values():
        assert imported in (ROOT / module).read_text(), module


def test_a_library_whose_internals_are_subclassed_has_an_upper_bound():
    for name in PRIVATE:
        uppers = [s for s in _requirement(name).specifier if s.operator == "<"]
        assert len(uppers) == 1, f"{name}: bound it above, below the minor release after the newest tested"
        assert Version(uppers[0].version).micro == 0, f"{name}: bound below a minor release, not a patch"


def test_the_tests_run_on_a_version_the_bounds_allow():
    """Run on a release above the bound, the tests say nothing of what users get: raise the
    bound once the whole suite has passed there."""
    for name in PRIVATE:
        assert _requirement(name).specifier.contains(metadata.version(name)), (name, metadata.version(name))
