import sys

from app.benchmark.cli import main

sys.exit(main())
