"""`python -m kvcache` runs the same command line as `kvcache`."""

import sys

from .cli import main

if __name__ == "__main__":  # (not when a spawned engine process imports it)
    sys.exit(main())
