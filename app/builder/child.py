"""The environment of a Python child process of a build (the ONNX export beside it, the package's
check in a fresh process): this one's, with the folder that holds ``app`` first on the path, so
the child imports the same yolopipe whether it is installed or run from a checkout."""

from __future__ import annotations

import os
from pathlib import Path


def child_env(**more: str) -> dict[str, str]:
    import app

    root = str(Path(app.__file__).resolve().parent.parent)
    return {**os.environ, **more, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
