"""Writes app/builder/architecture_tiles.json, the tiles a first build narrows its candidates to
(``app.builder.narrowed_choices``), from the tuning caches committed under bench/tuning/: each
one's best tiles, merged per compute capability. Run it after committing a card's cache:

    python tools/architecture_tiles.py

A unit test holds the packaged file to these caches.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.artifacts.tuning_cache import read_tuning_cache
from app.builder.narrowed_choices import ARCHITECTURE_TILES, tiles_by_architecture

CACHES = ROOT / "bench" / "tuning"


def main() -> int:
    caches = [read_tuning_cache(path) for path in sorted(CACHES.glob("*.json"))]
    content = tiles_by_architecture(cache for cache in caches if cache is not None)
    text = json.dumps(content, indent=1)
    text = re.sub(r"\{\s+(\"BLOCK_[^{}]*?)\s+\}", lambda tile: "{" + " ".join(tile.group(1).split()) + "}", text)
    ARCHITECTURE_TILES.write_text(text + "\n")  # a tile a line
    for capability, entry in content["architectures"].items():
        print(f"compute capability {capability}: {len(entry['tiles'])} operators from {'; '.join(entry['from'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
