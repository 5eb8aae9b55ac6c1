"""Random crops for the random-program tests: a layer cropped within what it can roll back, and the
same tokens dropped from the test's naive per-row lists of tokens."""

from __future__ import annotations

import random
from typing import Any

import torch


def crop_at_random(layer: Any, rows: list[list[Any]], rng: random.Random, *, ragged: bool,
                   as_tensor: bool = False) -> None:  # fmt: skip
    """Crop `layer` by a random count within its reach (one count for every row, or with `ragged`
    one per row, given as a list or, with `as_tensor`, a tensor) and drop as many from each row."""
    if ragged:
        counts = [rng.randint(0, r) for r in layer.row_rollback()]
        layer.crop(torch.tensor([-c for c in counts]) if as_tensor else [-c for c in counts])
    else:
        n = rng.randint(0, layer.max_rollback)
        layer.crop(-n)
        counts = [n] * len(rows)
    for row, c in zip(rows, counts, strict=True):
        del row[len(row) - c :]
