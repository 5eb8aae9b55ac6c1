"""How many tokens a speculative step drafts next."""

from __future__ import annotations


class DraftLength:
    """How many tokens to draft next: `maximum` always, or adapted to how the last drafts fared."""

    def __init__(self, maximum: int, *, adaptive: bool) -> None:
        self.maximum, self.adaptive, self.current = maximum, adaptive, maximum

    def update(self, proposed: int, accepted: int) -> None:
        if self.adaptive and proposed:
            step = 2 if accepted == proposed else -1
            self.current = max(1, min(self.maximum, self.current + step))
