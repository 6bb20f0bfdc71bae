"""The latency/throughput benchmark now lives in the package (``app.benchmark``); this wrapper
keeps ``python bench/latency.py [options]`` working. ``yolopipe bench`` runs the same code."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without `pip install -e`
from app.benchmark.cli import main  # noqa: E402

sys.exit(main())
