"""bench/results/README.md indexes the committed result files: each one is named there (with its
machine and what it measured), and each file it names is there."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
INDEX = RESULTS / "README.md"
# A result file's name: <date>-<machine>-<what>.<ext>, matched whole (a .log is not its .log.gz).
RESULT_NAME = re.compile(r"(?<![\w.-])\d{4}-\d\d-\d\d-[\w.-]*\w")


def result_files() -> set[str]:
    return {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p != INDEX}


def indexed_names(text: str) -> set[str]:
    return set(RESULT_NAME.findall(text))


def test_every_result_file_is_in_the_index():
    missing = sorted(result_files() - indexed_names(INDEX.read_text()))
    assert missing == [], f"bench/results/README.md does not name: {missing}"


def test_every_file_the_index_names_exists():
    absent = sorted(indexed_names(INDEX.read_text()) - result_files())
    assert absent == [], f"bench/results/README.md names files that are not in bench/results/: {absent}"


def test_names_are_matched_whole():
    text = "`2026-12-03-x-gpu-tests.log.gz`, and `2026-12-01-y-bench.json` (the run)."
    assert indexed_names(text) == {"2026-12-03-x-gpu-tests.log.gz", "2026-12-01-y-bench.json"}
