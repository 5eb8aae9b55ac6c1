"""`python -m kvcache` runs the same command line as `kvcache`."""

import sys

from .cli import main

sys.exit(main())
