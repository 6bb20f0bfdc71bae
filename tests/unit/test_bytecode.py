"""``app.bytecode``: where an interpreter would compile its imports at every start (bytecode
writing off, packages installed without bytecode), yolopipe keeps their bytecode in its cache,
and leaves every other interpreter as it is. Each case is a real interpreter on a package made
here."""

from __future__ import annotations

import compileall
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TAG = sys.implementation.cache_tag


@pytest.fixture
def site(tmp_path) -> Path:
    """A folder holding two packages with no bytecode: ``bigpkg`` (the one that decides) and
    ``otherpkg``."""
    folder = tmp_path / "site"
    for name in ("bigpkg", "otherpkg"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"NAME = {name!r}\n")
    return folder


def python(site: Path, cache: Path, code: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHE"))}
    environ.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), YOLOPIPE_CACHE_DIR=str(cache), **env)
    return subprocess.run([sys.executable, *flags, "-c", code], env=environ, capture_output=True, text=True,
                          timeout=60, check=True)


KEEP_THEN_IMPORT = """
import sys
from app.bytecode import keep_bytecode
print(keep_bytecode(("bigpkg",)), sys.pycache_prefix)
import bigpkg, otherpkg
print(bigpkg.__cached__)
"""


def kept(cache: Path, source: Path) -> Path:
    """Where Python keeps ``source``'s bytecode under yolopipe's prefix."""
    return cache / "bytecode" / TAG / source.parent.relative_to(source.anchor) / f"{source.stem}.{TAG}.pyc"


def test_with_writing_off_and_no_bytecode_the_bytecode_goes_to_the_cache_and_is_read_next_time(site, tmp_path):
    cache = tmp_path / "cache"
    first = python(site, cache, KEEP_THEN_IMPORT, PYTHONDONTWRITEBYTECODE="1")
    on, prefix = first.stdout.splitlines()[0].split()
    assert on == "True" and prefix == str(cache / "bytecode" / TAG)
    for name in ("bigpkg", "otherpkg"):
        assert kept(cache, site / name / "__init__.py").is_file()
        assert not (site / name / "__pycache__").exists()  # the package's folder is left as it was
    pyc = kept(cache, site / "bigpkg" / "__init__.py")
    written = pyc.stat().st_mtime_ns
    again = python(site, cache, KEEP_THEN_IMPORT, "-v", PYTHONDONTWRITEBYTECODE="1")
    assert f"code object from '{pyc}'" in again.stderr  # read, not compiled again
    assert pyc.stat().st_mtime_ns == written


def test_a_child_interpreter_started_with_writing_off_reads_and_writes_the_same_cache(site, tmp_path):
    """What a service worker is: spawned with ``-B`` (multiprocessing copies the parent's flags)
    and the parent's environment."""
    cache = tmp_path / "cache"
    parent = f"""
import subprocess, sys
from app.bytecode import keep_bytecode
keep_bytecode(("bigpkg",))
import bigpkg
subprocess.run([sys.executable, "-B", "-c", {KEEP_THEN_IMPORT!r}], check=True)
"""
    out = python(site, cache, parent, PYTHONDONTWRITEBYTECODE="1").stdout.splitlines()
    assert out[0] == f"True {cache / 'bytecode' / TAG}"
    assert kept(cache, site / "otherpkg" / "__init__.py").is_file()


@pytest.mark.parametrize("case", ["writing on", "bytecode installed", "the user's prefix"])
def test_an_interpreter_that_keeps_its_bytecode_is_left_alone(site, tmp_path, case):
    cache, env = tmp_path / "cache", {"PYTHONDONTWRITEBYTECODE": "1"}
    if case == "writing on":
        env = {}
    elif case == "bytecode installed":
        assert compileall.compile_dir(site / "bigpkg", quiet=1)
    else:
        env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "theirs")
    on, prefix = python(site, cache, KEEP_THEN_IMPORT, **env).stdout.splitlines()[0].split()
    assert on == "False" and not (cache / "bytecode").exists()
    assert prefix == {"the user's prefix": str(tmp_path / "theirs")}.get(case, "None")


def test_the_command_keeps_it_before_it_runs_anything(site, tmp_path):
    """``yolopipe``'s entry turns it on first (here ``bigpkg`` stands for torch)."""
    cache = tmp_path / "cache"
    code = """
import atexit, sys
import app.bytecode
app.bytecode.LARGE_PACKAGES = ("bigpkg",)
atexit.register(lambda: print("prefix", sys.pycache_prefix, sys.dont_write_bytecode))
from app.cli import main
sys.argv = ["yolopipe", "--version"]
main()
"""
    out = python(site, cache, code, PYTHONDONTWRITEBYTECODE="1").stdout
    assert f"prefix {cache / 'bytecode' / TAG} False" in out
