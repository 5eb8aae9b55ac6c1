"""`python -m benchmarks`: run the benchmark suite (see run.py and README.md)."""

import sys

from benchmarks.run import main

sys.exit(main())
