"""``python -m app.cli``: the ``yolopipe`` command."""

from app.cli import main

main()
