"""Every command's ``--help`` shows each help text as written: brackets, defaults and all.

The texts are read from the Click command objects Typer builds (and from ``BenchOptions`` for
``yolopipe bench``), so a new option is checked the day it is added.
"""

from __future__ import annotations

import re

import click
import pytest
import typer
from typer.testing import CliRunner

from app.cli import cli

ROOT = typer.main.get_command(cli)
COMMANDS = {name: ROOT.get_command(None, name) for name in ROOT.list_commands(None)}


def squeeze(text: str) -> str:
    # Line wrapping may split at any space (argparse also after a hyphen): compare without whitespace.
    return re.sub(r"\s+", "", text)


def render(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "bench"])
def test_every_help_text_is_shown_whole(name):
    command = COMMANDS[name]
    shown = render(name)
    params = [p for p in command.params if getattr(p, "help", None)]
    assert params, "a command without option help is itself a gap"
    for param in params:
        assert squeeze(param.help) in squeeze(shown), (name, param.name, param.help)
    assert squeeze(command.help.split("\n\n")[0]) in squeeze(shown)


def test_flags_take_no_value_and_usage_names_arguments_plainly():
    for name, command in {"": ROOT, **COMMANDS}.items():
        if name == "bench":
            continue
        shown = render(*([name] if name else []))
        assert "<bool>" not in shown and "{" not in shown.splitlines()[0] and "<list[" not in shown, shown
        for param in command.params:
            if isinstance(param, click.Option) and param.is_flag:
                flag_line = next(line for line in shown.splitlines() if param.opts[0] in line)
                assert "<" not in flag_line.split(param.opts[0], 1)[1].split("  ")[0], flag_line
    assert render("predict").splitlines()[0] == "Usage: yolopipe predict [OPTIONS] SOURCE"


def test_the_words_in_brackets_survive():
    assert "pip install 'yolopipe[ray]'" in " ".join(render("predict").split())
    method = next(p for p in COMMANDS["calibrate"].params if p.name == "method")
    bracket = method.help[method.help.index("[default:"):].split("]")[0] + "]"  # written in the help text
    assert " ".join(bracket.split()) in " ".join(render("calibrate").split())
    assert "[default: ~/.cache/yolopipe/artifacts]" in " ".join(render("export").split())


def test_the_top_level_lists_every_command_with_its_summary():
    shown = render()
    for name, command in COMMANDS.items():
        summary = command.help.split("\n\n")[0].strip()
        assert re.search(rf"^\s+{re.escape(name)}\s+{re.escape(summary)}$", shown, re.MULTILINE), (name, shown)


def test_bench_help_shows_every_option_whole():
    from dataclasses import fields

    from app.benchmark.cli import _parser
    from app.benchmark.options import BenchOptions

    shown = _parser("yolopipe bench").format_help()
    for f in fields(BenchOptions):
        flag = f"--{f.name.replace('_', '-')}"
        assert flag in shown and squeeze(f.metadata["help"]) in squeeze(shown), (flag, shown)
