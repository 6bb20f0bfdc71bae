"""The benchmark that ``yolopipe bench`` runs: Ultralytics and yolopipe on the same model and
images in one run (``run_benchmark``), results as one JSON file of flat rows."""

from app.benchmark.options import BenchOptions
from app.benchmark.run import run_benchmark

__all__ = ["BenchOptions", "run_benchmark"]
