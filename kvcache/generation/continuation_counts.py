"""How often each token followed each short context in the token lists fed so far: the counts a
suffix drafter proposes from (`kvcache.generation.suffix`), shared by a corpus and by each
drafter's own sequence."""

from __future__ import annotations

from collections.abc import Sequence

Context = tuple[int, ...]


class ContinuationCounts:
    """How often each token followed each context of 1 to `depth` tokens, over fed token lists.

    A context is keyed by the hash of its tokens (an int, not the tuple). Two contexts of one hash
    would share counts; that can only make a draft worse, never an output: every draft is
    verified by the target. Most long contexts were followed by one token only: theirs is held as
    one int (`count << 32 | token`), a dict only once a second token follows (a fifth of the
    memory of a dict each)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.counts: dict[int, int | dict[int, int]] = {}

    def add(self, tokens: Sequence[int], start: int = 0, sign: int = 1) -> None:
        """Count (or with `sign=-1` uncount) every continuation of `tokens` whose next token is at
        position `start` or later."""
        first, depth = max(start, 1), self.depth
        base = max(first - depth, 0)  # the tokens the new contexts reach back to, as a tuple (its slices are)
        counts, tokens = self.counts, tuple(tokens[base:])
        for end in range(first - base, len(tokens)):
            following = tokens[end]
            for begin in range(end - 1, max(end - depth, 0) - 1, -1):
                key = hash(tokens[begin:end])
                held = counts.get(key)
                if held is None:
                    counts[key] = 1 << 32 | following  # sign is +1: a sequence is uncounted only once counted
                elif isinstance(held, dict):
                    left = held.get(following, 0) + sign
                    if left > 0:
                        held[following] = left
                    else:
                        del held[following]
                        if len(held) == 1:
                            ((token, count),) = held.items()
                            counts[key] = count << 32 | token
                elif held & 0xFFFFFFFF == following:
                    count = (held >> 32) + sign
                    if count > 0:
                        counts[key] = count << 32 | following
                    else:
                        del counts[key]
                else:
                    counts[key] = {held & 0xFFFFFFFF: held >> 32, following: 1}

    def seen(self, context: Context) -> bool:
        """Whether `context` was followed by some token (then every suffix of it was too)."""
        return hash(context) in self.counts

    def get(self, context: Context) -> dict[int, int] | None:
        held = self.counts.get(hash(context))
        if held is None or isinstance(held, dict):
            return held
        return {held & 0xFFFFFFFF: held >> 32}
