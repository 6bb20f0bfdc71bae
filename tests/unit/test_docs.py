"""The docs name only things that exist: repository paths, command options, YOLOPIPE_* variables.

Read from the docs themselves, section by section, so a new section is checked the day it is
written. An option is checked against its own command where the text says which one
(``yolopipe predict ... --ray``, ``python bench/http_load.py ... --clients``, a fenced block's
continuation lines), else against every option a yolopipe command or benchmark script has.
"""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest
import typer

from app.benchmark.options import BenchOptions
from app.cli import cli
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "bench/README.md", "docker/README.md", "calibration/README.md", "engines/README.md",
        "tools/device/README.md"]
TOP = ("app", "bench", "tests", "docker", "calibration", "engines", "tools", ".ci")
# Options of the other programs the docs show (pip, docker, curl): not ours to check.
FOREIGN_OPTIONS = {"--index-url", "--rm", "--gpus", "--data-binary", "--build"}


def click_options(command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def script_options(path: Path) -> set[str]:
    """The ``--options`` an argparse script declares (read from its source, not run)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            found.update(names)
            if any(getattr(k.value, "attr", "") == "BooleanOptionalAction" for k in node.keywords if k.arg == "action"):
                found.update(f"--no-{name[2:]}" for name in names)  # argparse adds the negative form
    return found


def known_options() -> dict[str, set[str]]:
    group = typer.main.get_command(cli)
    known = {f"yolopipe {name}": click_options(group.get_command(None, name)) for name in group.list_commands(None)}
    for script in sorted([*(ROOT / "bench").glob("*.py"), *(ROOT / "tools" / "device").glob("*.py")]):
        known[script.relative_to(ROOT).as_posix()] = script_options(script) | {"--help"}
    bench = {f"--{f.name.replace('_', '-')}" for f in fields(BenchOptions)} | {"--help"}
    known["yolopipe bench"] = known["app.benchmark"] = bench
    known["yolopipe"] = click_options(group)
    return known


def pytest_options(config: pytest.Config) -> set[str]:
    """The ``--options`` of the pytest running this test, its plugins' included (xdist, timeout)."""
    parser = config._parser  # no public list of them; --help prints the same
    return {name for option in [*parser._anonymous.options, *(o for g in parser._groups for o in g.options)]
            for name in option.names() if name.startswith("--")}


KNOWN = known_options()
EVERY_OPTION = set().union(*KNOWN.values())
COMMAND = re.compile(r"\b(yolopipe (?:" + "|".join(n.split()[1] for n in KNOWN if n.startswith("yolopipe "))
                     + r")\b|bench/[\w-]+\.py|app\.benchmark|pytest(?![\w-]))")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def doc_text(name: str) -> str:
    return (ROOT / name).read_text()


def fenced_lines(text: str) -> list[str]:
    """The lines of fenced code blocks, continuation lines (``\\``) joined, block boundaries kept as ''."""
    out, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            out.append("")
            continue
        if inside:
            pending += line.split(" # ")[0] if not line.lstrip().startswith("#") else ""
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            out.append(pending)
            pending = ""
    return out


def inline_spans(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]  # a span may wrap


def option_mentions(text: str) -> list[tuple[str | None, str, str]]:
    """``(command or None, --option, where)`` for every option the doc names."""
    found = []
    command = None  # a fenced block's lines that start with -- continue the command above them
    for line in fenced_lines(text):
        if not line.strip():
            command = None
            continue
        commands = list(COMMAND.finditer(line))
        if commands:
            for k, match in enumerate(commands):
                end = commands[k + 1].start() if k + 1 < len(commands) else len(line)
                found += [(match.group(1), o, line) for o in OPTION.findall(line[match.end():end])]
            command = commands[-1].group(1)
        elif line.lstrip().startswith("--") and command:
            found += [(command, o, line) for o in OPTION.findall(line)]
        else:
            found += [(None, o, line) for o in OPTION.findall(line)]
    for span in inline_spans(text):
        match = COMMAND.search(span)
        found += [(match.group(1) if match else None, o, span) for o in OPTION.findall(span)]
    return found


PATH = re.compile(r"(?<![\w./~<>$-])((?:" + "|".join(re.escape(t) for t in TOP)
                  + r")/[\w./-]*[\w/]|Dockerfile|pyproject\.toml)(?![\w<>*])")


def repo_paths(text: str) -> set[str]:
    """Paths inside this repository: rooted at one of its top-level folders, or (inline) a
    ``.py`` file named relative to ``app/``, or a committed result file named alone."""
    found = {m.group(1) for m in PATH.finditer(text)}
    for span in inline_spans(text):
        if re.fullmatch(r"[\w/]+\.py", span) and not PATH.fullmatch(span):
            found.add(f"app/{span}")
        if re.fullmatch(r"\d{4}-\d\d-\d\d-[\w.-]+\.(json|log)", span):
            found.add(f"bench/results/{span}")
    return {p.rstrip("/.") for p in found if not p.startswith("app/api/static/")}


def known_variables() -> set[str]:
    """``YOLOPIPE_*`` names the code reads: the settings, and any the sources spell out."""
    names = {f"YOLOPIPE_{name.upper()}" for name in Settings.model_fields}
    for path in [*ROOT.glob("app/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*"), ROOT / ".ci/run",
                 ROOT / "Dockerfile", ROOT / "docker/compose.yaml"]:
        if path.is_file() and path != Path(__file__).resolve():
            names.update(re.findall(r"YOLOPIPE_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="ignore")))
    return names


@pytest.mark.parametrize("doc", DOCS)
def test_every_repository_path_the_doc_names_exists(doc):
    missing = sorted(p for p in repo_paths(doc_text(doc)) if not (ROOT / p).exists())
    assert missing == [], f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_no_path_outside_the_repository(doc):
    """A user's clone has nothing next to it: ``../something`` would name a file they lack."""
    outside = sorted(set(re.findall(r"(?<![\w.])\.\./[\w./-]+", doc_text(doc))))
    assert outside == [], f"{doc} names files outside the repository: {outside}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_option_the_doc_names_exists_for_its_command(doc, pytestconfig):
    known = {**KNOWN, "pytest": pytest_options(pytestconfig)}
    wrong = []
    for command, option, where in option_mentions(doc_text(doc)):
        if option in FOREIGN_OPTIONS and command is None:
            continue
        allowed = known.get(command, EVERY_OPTION) if command else EVERY_OPTION
        if option not in allowed:
            wrong.append(f"{option} ({command or 'any command'}): {where.strip()}")
    assert wrong == [], f"{doc}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("doc", DOCS)
def test_every_yolopipe_variable_the_doc_names_exists(doc):
    named = set(re.findall(r"YOLOPIPE_[A-Z0-9_]*[A-Z0-9]", doc_text(doc)))
    assert sorted(named - known_variables()) == [], doc


def test_the_checks_catch_what_went_stale(pytestconfig):
    """Each check, on the stale lines this repository's docs once had."""
    stale = ("```bash\n# options\n--lanes N --threads T   throughput rows\n```\n"
             "`python -m pytest -n auto --dist-mode loadfile`\n"
             "`python bench/http_load.py --engines-dir DIR`\n"
             "```bash\nyolopipe predict samples \\\n  --lanes 2\n```\n"
             "`YOLOPIPE_MAX_QUEUE` and `../shared/device/wrk.sh` and `bench/results/nothing.json` and `serving/ring.py`")
    options = {(c, o) for c, o, _ in option_mentions(stale)}
    assert {(None, "--lanes"), (None, "--threads"), ("bench/http_load.py", "--engines-dir"),
            ("yolopipe predict", "--lanes")} <= options
    assert not any(o in KNOWN["bench/http_load.py"] for o in ("--engines-dir",))
    assert "--lanes" not in EVERY_OPTION and "--ray" in KNOWN["yolopipe predict"]
    assert ("pytest", "--dist-mode") in options and "--dist" in pytest_options(pytestconfig)
    assert "--dist-mode" not in pytest_options(pytestconfig)
    paths = repo_paths(stale)
    assert "bench/results/nothing.json" in paths and "app/serving/ring.py" in paths
    assert re.findall(r"(?<![\w.])\.\./[\w./-]+", stale) == ["../shared/device/wrk.sh"]
    assert "YOLOPIPE_MAX_QUEUE" not in known_variables() and "YOLOPIPE_MAX_BATCH" in known_variables()
