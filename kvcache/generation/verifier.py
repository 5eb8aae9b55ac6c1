"""Picking and verifying tokens alike for a target and its drafter: greedy or sampled (`Sampling`),
and the speculative-decoding acceptance rule (greedy: the target's argmax; sampled: the
speculative-sampling rule), so that speculation changes neither a greedy output nor a sampled
one's distribution."""

from __future__ import annotations

import torch

from .drafters import Draft
from .sampling import Sampling, ban_ends


class Verifier:
    """Greedy picking, or temperature / top-k / top-p sampling (`Sampling`, the same processing
    `generate` uses), applied alike to the target and a draft model, and the acceptance rule."""

    def __init__(self, sampling: Sampling, generator: torch.Generator | None, *, ends: frozenset[int] = frozenset(),
                 min_new_tokens: int = 0) -> None:  # fmt: skip
        self.sampling = sampling
        self.do_sample = sampling.do_sample
        self.generator = generator
        self.ends, self.min_new_tokens = ends, min_new_tokens  # (end tokens banned before that many new ones)

    def ban(self, logits: torch.Tensor, made: int) -> None:
        """In place: the end tokens of `logits` `[positions, vocab]` (the target's, position j
        choosing the new token after `made + j`) banned before `min_new_tokens` (`ban_ends`)."""
        ban_ends(logits, made, self.min_new_tokens, self.ends)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution of each row of `logits` `[rows, vocab]` (float32)."""
        return self.sampling.scores(logits).softmax(-1)

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft model's choice at one position: its argmax, or a sample and its distribution."""
        if not self.do_sample:
            return int(self.sampling.scores(logits[None]).argmax()), None
        q = self.probs(logits[None])[0]
        return self.sample(q), q

    def pick_rows(self, logits: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        """`pick` for each row of `logits` `[rows, vocab]`; greedy reads all rows' choices at once
        (one host transfer for the batch)."""
        if not self.do_sample:
            return [(t, None) for t in self.sampling.scores(logits).argmax(-1).tolist()]
        return [self.pick(row) for row in logits]

    def verify_rows(self, drafts: list[Draft], logits: torch.Tensor) -> list[tuple[int, list[int]]]:
        """`verify` for each batch row (`logits` `[rows, width, vocab]`, row i's first
        `len(drafts[i]) + 1` positions its own); greedy reads every choice in one host transfer."""
        if self.do_sample:
            return [self.verify(d, logits[i, : len(d.tokens) + 1]) for i, d in enumerate(drafts)]
        choices = self.sampling.scores(logits.flatten(0, 1)).argmax(-1).view(logits.shape[:2]).tolist()
        out = []
        for draft, choice in zip(drafts, choices, strict=True):
            accepted = 0
            while accepted < len(draft.tokens) and draft.tokens[accepted] == choice[accepted]:
                accepted += 1
            out.append((accepted, [*draft.tokens[:accepted], choice[accepted]]))
        return out

    def _counts(self, draft: Draft, counts: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor | None:
        """The generated tokens' counts at each verified position `[n + 1, vocab]` (the penalties'):
        `counts` (those before the draft) plus the draft tokens before the position; None without
        penalties."""
        if not self.sampling.penalized:
            return None
        vocab, device = logits.shape[-1], logits.device
        steps = torch.zeros(len(draft.tokens) + 1, vocab, device=device)
        if draft.tokens:
            drafted = torch.tensor(draft.tokens, device=device)
            steps[1:] = torch.nn.functional.one_hot(drafted, vocab).float().cumsum(0)
        return steps if counts is None else steps + counts.to(device=device, dtype=torch.float32)

    def verify(self, draft: Draft, target_logits: torch.Tensor, counts: torch.Tensor | None = None,
               seen: torch.Tensor | None = None) -> tuple[int, list[int]]:  # fmt: skip
        """Check `draft` against the target's logits for the pending token and every draft token
        (`[n + 1, vocab]`); return (number of draft tokens accepted, tokens to append). `counts`
        `[vocab]`: how often each token was generated before the draft (for the penalties); `seen`
        `[vocab]`: the prompt's tokens (for the repetition penalty)."""
        n = len(draft.tokens)
        positions = self._counts(draft, counts, target_logits)
        if not self.do_sample:  # greedy: the argmax of the raw logits (as float32, the same order), biased if asked
            raw = self.sampling.argmax_only
            scores = target_logits if raw else self.sampling.scores(target_logits, positions, seen)
            choice = scores.argmax(-1).tolist()
            accepted = 0
            while accepted < n and draft.tokens[accepted] == choice[accepted]:
                accepted += 1
            return accepted, [*draft.tokens[:accepted], choice[accepted]]
        p = self.sampling.scores(target_logits, positions, seen).softmax(-1)
        if draft.probs is None:  # point masses (or nothing): plain sampling's draws, position by position
            drawn = []
            for proposed in draft.tokens:
                drawn.append(self.sample(p[len(drawn)]))
                if drawn[-1] != proposed:
                    return len(drawn) - 1, drawn
            return n, [*drawn, self.sample(p[n])]
        proposed = torch.tensor(draft.tokens, device=p.device)
        rows = torch.arange(n, device=p.device)
        p_x = p[rows, proposed]
        q_x = draft.probs[rows, proposed].to(p.dtype)
        # Accept x with probability min(1, p(x) / q(x)); keep the prefix before the first rejection.
        uniform = torch.rand(n, generator=self.generator, device=p.device, dtype=p.dtype)
        rejected = (uniform * q_x > p_x).tolist()
        accepted = rejected.index(True) if True in rejected else n
        if accepted == n:
            return n, [*draft.tokens, self.sample(p[n])]  # the bonus token, from the target alone
        residual = (p[accepted] - draft.probs[accepted].to(p.dtype)).clamp_min(0)
        if not bool(residual.sum() > 0):  # p == q up to rounding: a rejection had probability ~0
            residual = p[accepted]
        return accepted, [*draft.tokens[:accepted], self.sample(residual / residual.sum())]
