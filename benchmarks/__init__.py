"""kvcache's benchmark suite: `python -m benchmarks [--quick | --full]` (see benchmarks/README.md).

The per-issue scripts (append.py, recurrent_rollback.py, persistence.py, generation.py,
speculative.py) also run on their own; the suite calls their measurement functions.
"""
