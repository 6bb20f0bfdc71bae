"""bench/startup.py's outside timing: a command's first and last results and its exit, told apart."""

import sys
from pathlib import Path

from bench.startup import timed

CHILD = """
import sys, time
out = open(sys.argv[1], "w")
time.sleep(0.3)
out.write("first\\n"); out.flush()
time.sleep(0.5)
out.write("last\\n"); out.flush()
time.sleep(0.5)
"""


def test_timed_tells_the_first_result_the_last_and_the_exit_apart(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    row = timed([sys.executable, "-c", CHILD, str(out)], env=None, log=tmp_path / "log", out=out, timeout=30)
    assert row["exit_code"] == 0
    # each gap holds its sleep (the looks are 5 ms apart; a slow start only shifts them all)
    assert row["last_result_s"] - row["first_result_s"] >= 0.45
    assert row["wall_s"] - row["last_result_s"] >= 0.45
    assert row["first_result_s"] >= 0.3


def test_timed_without_results(tmp_path: Path) -> None:
    out = tmp_path / "never.jsonl"
    row = timed([sys.executable, "-c", "pass"], env=None, log=tmp_path / "log", out=out, timeout=30)
    assert row["exit_code"] == 0 and row["first_result_s"] is None and row["last_result_s"] is None
