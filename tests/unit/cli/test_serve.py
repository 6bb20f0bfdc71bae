"""``serve``'s options become the service's ``Settings``, and those its detector's ``OpenOptions``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.runtime import options_from
from app.settings import Settings


@pytest.mark.parametrize(("args", "env", "letterbox"), [
    ([], {}, "rect"),  # Ultralytics' predict default
    (["--square"], {}, "square"),
    ([], {"YOLOPIPE_LETTERBOX": "square"}, "square"),
    ([], {"YOLOPIPE_LETTERBOX": "rect"}, "rect"),
])
def test_the_letterbox_reaches_the_detector_the_service_opens(args, env, letterbox, monkeypatch):
    import app.service.supervisor

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    served: list[Settings] = []
    monkeypatch.setattr(app.service.supervisor, "serve", served.append)
    result = CliRunner().invoke(cli, ["serve", *args])
    assert result.exit_code == 0, result.output
    (settings,) = served
    assert settings.letterbox == letterbox and options_from(settings).shape.letterbox == letterbox


def test_an_unknown_letterbox_is_refused(monkeypatch):
    monkeypatch.setenv("YOLOPIPE_LETTERBOX", "wide")
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2 and "letterbox" in result.output
