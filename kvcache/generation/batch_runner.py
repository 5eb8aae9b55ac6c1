"""The rows of a batched speculative run on one model (the target, or a draft model): their cache,
left padding and lengths, fed one forward for all rows and cropped back by each row's own count;
and a draft model proposing for every row at once on such a runner."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import GenerationError
from ..layers.quantized_rows import rows_quantized_alone
from ..protocol import last_logits
from .drafters import Draft, ModelDrafter
from .switches import holds_recurrent_states


class BatchRunner:
    """A model and its cache decoding rows that hold different numbers of tokens.

    `held[i]` is how many real tokens row i's cache holds (its next position); `pads[i]` the left
    padding in front of them (slots the prefill wrote and the mask hides). `feed` takes one token
    list per row; shorter lists are padded with filler tokens, which the caller then drops with
    `keep`.
    """

    def __init__(self, model: Any, *, device: torch.device, encoder: dict[str, Any] | None = None) -> None:
        self.model = model
        self.device = device
        self.cache = model.new_cache()
        self.encoder = dict(encoder or {})  # encoder_hidden_states / encoder_attention_mask, per row
        self.pads: list[int] = []
        self.held: list[int] = []
        self.forwards = 0
        #: the model leaves a row's fillers out of its linear layers (`tokens_per_row`)
        self.packs_rows = bool(getattr(model, "packs_rows", False)) and not self.encoder

    def _call(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
              keep: dict[str, Any] | None = None) -> torch.Tensor:  # fmt: skip
        with torch.no_grad():
            logits = self.model(input_ids, cache=self.cache, attention_mask=mask, position_ids=position_ids,
                                **self.encoder, **(keep or {}))  # fmt: skip
        self.forwards += 1
        return logits

    def _mask(self, new: int) -> torch.Tensor | None:
        """Left padding over every slot the next forward's keys span; None without padding."""
        if not any(self.pads):
            return None
        span = self.cache.get_seq_length() + new
        pads = torch.tensor(self.pads, device=self.device)[:, None]
        return (torch.arange(span, device=self.device)[None, :] >= pads).long()

    def prefill(self, rows: list[list[int]]) -> None:
        """Feed every row's tokens but its last, left-padded to one length, then record."""
        longest = max(len(r) for r in rows) - 1
        self.pads = [longest - (len(r) - 1) for r in rows]
        self.held = [len(r) - 1 for r in rows]
        if longest > 0:
            ids = torch.tensor([[0] * p + r[:-1] for p, r in zip(self.pads, rows, strict=True)], device=self.device)
            columns = torch.arange(longest, device=self.device)[None, :]
            pads = torch.tensor(self.pads, device=self.device)[:, None]
            mask = (columns >= pads).long() if any(self.pads) else None
            keep = {} if self.encoder else last_logits(self.model)  # nobody reads the prompt's logits
            with rows_quantized_alone(self.cache, self.pads):  # quantized: each row at its own positions
                self._call(ids, (columns - pads).clamp(min=0), mask, keep)
        self.cache.activate_past_recording()
        self.forwards = 0  # count decoding forwards only

    def feed(self, rows: list[list[int]], filler: list[int]) -> torch.Tensor:
        """Run one forward on each row's tokens (shorter rows padded with their `filler` token,
        left out of the computation where the model `packs_rows`); return the logits `[batch,
        longest, vocab]` (a filler's unspecified). Every fed token, filler included, is held."""
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [f] * (width - len(r)) for r, f in zip(rows, filler, strict=True)], device=self.device)
        start = torch.tensor(self.held, device=self.device)[:, None]
        mask = self._mask(width)
        counts = [len(r) for r in rows]
        packing = {"tokens_per_row": counts} if self.packs_rows and min(counts) < width else None
        logits = self._call(ids, start + torch.arange(width, device=self.device), mask, packing)
        self.held = [h + width for h in self.held]
        return logits

    def keep(self, counts: list[int]) -> None:
        """Keep `counts[i]` real tokens in row i (dropping the rest per row, exactly), and commit."""
        drop = [h - c for h, c in zip(self.held, counts, strict=True)]
        if any(drop):
            self.cache.crop(torch.tensor([-d for d in drop]))
        self.cache.crop(0)
        self.held = list(counts)

    def select(self, rows: list[int]) -> None:
        """Keep only batch rows `rows` (finished rows leave)."""
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index)
        self.pads = [self.pads[i] for i in rows]
        self.held = [self.held[i] for i in rows]
        for name, value in self.encoder.items():
            if isinstance(value, torch.Tensor):
                self.encoder[name] = value[index.to(value.device)]


class BatchModelDrafter:
    """A draft model proposing for every row at once: one catch-up forward of the tokens each row's
    draft cache lacks, then one single-token forward per further draft token."""

    def __init__(self, drafter: ModelDrafter, device: torch.device, encoder: dict[str, Any] | None) -> None:
        self.runner = BatchRunner(drafter.model, device=device, encoder=encoder)
        self.tokens: list[list[int]] = []  # what each row's draft cache holds

    def start(self, rows: list[list[int]]) -> None:
        self.runner.prefill(rows)
        self.tokens = [list(r[:-1]) for r in rows]

    def propose(self, sequences: list[list[int]], budgets: list[int], verifier: Any) -> list[Draft]:
        most = max(budgets)
        if most == 0:
            return [Draft([]) for _ in sequences]
        missing = [s[len(t):] for s, t in zip(sequences, self.tokens, strict=True)]
        logits = self.runner.feed(missing, [s[-1] for s in sequences])
        last = torch.tensor([len(m) - 1 for m in missing], device=logits.device)
        step_logits = logits[torch.arange(len(sequences), device=logits.device), last]
        self.runner.keep([len(s) for s in sequences])  # drop the catch-up fillers
        self.tokens = [list(s) for s in sequences]
        tokens: list[list[int]] = [[] for _ in sequences]
        probs: list[list[torch.Tensor | None]] = [[] for _ in sequences]
        for i in range(most):
            for b, (token, q) in enumerate(verifier.pick_rows(step_logits)):
                tokens[b].append(token)
                probs[b].append(q)
            if i + 1 < most:
                step_logits = self.runner.feed([[t[-1]] for t in tokens], [0] * len(tokens))[:, -1]
                for b, t in enumerate(tokens):
                    self.tokens[b].append(t[-1])
        drafts = []
        for b, budget in enumerate(budgets):
            row_probs = probs[b][:budget]
            stacked = None if not row_probs or any(q is None for q in row_probs) else torch.stack(row_probs)
            drafts.append(Draft(tokens[b][:budget], stacked))  # type: ignore[arg-type]
        return drafts

    def accept(self, sequences: list[list[int]]) -> None:
        """Roll each row's draft cache back to the tokens the target kept."""
        keep = []
        for seq, held in zip(sequences, self.tokens, strict=True):
            n = 0
            limit = min(len(held), len(seq) - 1)
            while n < limit and held[n] == seq[n]:
                n += 1
            keep.append(n)
        self.runner.keep(keep)
        self.tokens = [held[:n] for held, n in zip(self.tokens, keep, strict=True)]

    def select(self, rows: list[int]) -> None:
        self.runner.select(rows)
        self.tokens = [self.tokens[i] for i in rows]


def needs_row_states(runner: BatchRunner, who: str, row_states: bool) -> None:
    """Refuse a model whose recurrent states could not be cropped per row inside a forward (after
    the prefill: conv windows alone, as LFM2's, roll back to any token)."""
    if not row_states and holds_recurrent_states(runner.cache):
        raise GenerationError(
            f"batched speculative decoding needs per-token recurrent states from the {who} "
            f"({type(runner.model).__name__}: no set_return_intermediate_states or set_per_token_recurrence, or "
            "intermediate_states=False): "
            "rows accept different counts, and a recurrent layer can only land inside a forward on those states"
        )
