"""One model and its cache inside speculative decoding: feed tokens, remember them, roll back exactly.

Both the target and a draft model go through a `ModelRunner`. It knows which tokens its cache
holds and how the forwards since the last commit were chunked, because a recurrent layer can only
be cropped inside a forward when the model handed the per-token intermediate states over; where
it did not, `truncate` crops to the start of that forward and re-feeds the kept tokens instead
(the "refeed" path), so the result is the same either way and the caller learns which path ran.
With `defer_refeed=True` the kept tokens are not fed at once: they stay out of the cache (the
caller feeds them in front of its next forward), so a rejection costs no forward of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import GenerationError, RollbackError
from ..protocol import last_logits

#: `ModelRunner.truncate` results: nothing to drop, dropped by one exact crop, or by crop + re-feed.
NO_ROLLBACK, CROP, REFEED = "none", "crop", "refeed"
#: One-token forwards take their position ids from views made this many at a time.
POSITION_BLOCK = 256


class ModelRunner:
    """Feeds batch-1 token chunks to a `CausalLM` or `EncoderDecoderLM` and keeps its cache exact.

    `tokens` are the tokens the cache holds, in order; positions are counted from them (so a cache
    made of recurrent layers only, which has no sequence length, still gets the right positions).
    """

    def __init__(
        self,
        model: Any,
        *,
        device: torch.device,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        model_kwargs: dict[str, Any] | None = None,
        cache: Any = None,
    ) -> None:
        self.model = model
        self.device = device
        self.vocab_size = int(model.vocab_size)
        self.is_encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
        self.cache = model.new_cache() if cache is None else cache
        self.tokens: list[int] = []
        self.forwards = 0  # model calls, re-feeds included
        self.refeeds = 0  # model calls spent on the re-feed fallback
        self._step_sizes: list[int] = []  # sizes of the forwards since the commit point
        self._committed_length = 0  # tokens held at the commit point
        self._recording = False  # whether the cache records (set by `start_recording`, `feed`)
        self._positions = torch.arange(0, device=device)[None]
        self._ids = torch.arange(self.vocab_size, device=device).view(-1, 1, 1)  # [[id]] for every id
        # one-token inputs, made once: a decoding step then indexes no tensor to build its inputs
        self._id_views: dict[int, torch.Tensor] = {}  # id -> its [[id]], for the ids fed so far
        self._position_views: tuple[torch.Tensor, ...] = ()  # [[p]] for the `POSITION_BLOCK` from
        self._position_base = 0  # this position on
        self._kwargs = dict(model_kwargs or {})  # what every forward passes on
        if self.is_encoder_decoder:
            if encoder_input_ids is None:
                raise GenerationError(f"{type(model).__name__} is an encoder-decoder model: it needs encoder input ids")
            with torch.no_grad():
                hidden = model.encode(encoder_input_ids, encoder_attention_mask)
            self._kwargs.update(encoder_hidden_states=hidden, encoder_attention_mask=encoder_attention_mask)

    @property
    def committed_length(self) -> int:
        """Tokens held at the commit point (no rollback reaches below it)."""
        return self._committed_length

    def feed(self, tokens: Sequence[int], *, rollback: bool = True, last_only: bool = False) -> torch.Tensor:
        """Run the model on `tokens` (ints, appended to its cache); return their logits
        `[len(tokens), vocab]` (`last_only`: the last token's alone, `[1, vocab]`, the head run on
        that position only where the model takes `logits_to_keep`: a prompt's). `rollback=False`:
        nothing of this forward will be cropped (a plain step), so the cache does not record it (no
        snapshots, no history): it is committed at once. A decoding step runs it once per token, so
        it does no work a step can skip."""
        if rollback != self._recording:
            if rollback:
                self.start_recording()
            else:
                self.cache.stop_past_recording()
                self._recording = False
                self._step_sizes.clear()
        n = len(tokens)
        start = len(self.tokens)
        if n == 1:  # views made once: no new tensor, no copy to a device
            input_ids, position_ids = self._one_id(tokens[0]), self._one_position(start)
        else:
            input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
            position_ids = self._position_range(start, n)
        kwargs = self._kwargs
        if last_only and n > 1 and not self.is_encoder_decoder:
            kwargs = {**kwargs, **last_logits(self.model)}
        if torch.is_grad_enabled():
            with torch.no_grad():
                logits = self.model(input_ids, cache=self.cache, position_ids=position_ids, **kwargs)
        else:  # inside the caller's no-grad scope (the decoding loop's): entering another per step costs
            logits = self.model(input_ids, cache=self.cache, position_ids=position_ids, **kwargs)
        rows = 1 if "logits_to_keep" in kwargs else n
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != (1, rows):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise GenerationError(f"{type(self.model).__name__} returned logits {shape}, expected [1, {rows}, vocab]")
        self.tokens.extend(tokens)
        if rollback:
            self._step_sizes.append(n)
        else:
            self._committed_length = len(self.tokens)
        self.forwards += 1
        return logits[0, -1:] if last_only else logits[0]

    def _one_id(self, token: int) -> torch.Tensor:
        """Input ids `[[token]]`: a view kept for the next time this id is fed."""
        view = self._id_views.get(token)
        if view is None:
            if not 0 <= token < self._ids.shape[0]:  # out of range: the model says what is wrong
                return torch.tensor([[token]], dtype=torch.long, device=self.device)
            view = self._id_views[token] = self._ids[token]
        return view

    def _position_range(self, start: int, n: int) -> torch.Tensor:
        """Position ids `[1, n]` from `start`: views of one range, grown by doubling."""
        if start + n > self._positions.shape[1]:
            self._positions = torch.arange(2 * (start + n), device=self.device)[None]
        return self._positions[:, start : start + n]

    def _one_position(self, start: int) -> torch.Tensor:
        """Position ids `[[start]]`: one of a block of views made together, so a decoding step
        slices no tensor (a rollback behind the block's start makes a new block)."""
        at = start - self._position_base
        if not 0 <= at < len(self._position_views):  # a new block of views, made in one call
            self._position_base, at = start, 0
            self._position_views = self._position_range(start, POSITION_BLOCK).view(-1, 1, 1).unbind(0)
        return self._position_views[at]

    def prefill(self, prompt: Sequence[int], *, whole: bool = False) -> torch.Tensor | None:
        """Feed `prompt` but its last token, past what the cache already holds (a cache handed in
        holds a prefix of it), then make that the commit point and start recording. `whole=True`:
        feed the last token too and return its logits `[vocab]` (the first decoding step's), and
        leave recording to the first forward that may be cropped."""
        held = getattr(self.cache, "self_attention_cache", self.cache).get_seq_length()
        if held >= len(prompt):
            raise GenerationError(
                f"the cache already holds {held} token(s) but the sequence has {len(prompt)}: pass the whole "
                "sequence so far; the cache's tokens are skipped"
            )
        self.tokens = [int(t) for t in prompt[:held]]
        last = None
        if whole:
            last = self.feed(prompt[held:], rollback=False, last_only=True)[-1]
        elif held < len(prompt) - 1:  # not recorded: the prompt costs no rollback memory
            self.feed(prompt[held:-1], rollback=False, last_only=True)
        if not whole:
            self.start_recording()
        self.forwards = 0  # count decoding forwards only
        return last

    def start_recording(self) -> None:
        """Make the current content the commit point and record what rollback needs from now on."""
        self.cache.activate_past_recording()
        self._recording = True
        self._step_sizes.clear()
        self._committed_length = len(self.tokens)

    def truncate(self, length: int, *, defer_refeed: bool = False) -> str:
        """Keep the first `length` tokens, exactly as if nothing after them had been fed, then commit.

        Tries one exact `crop`; where the cache refuses (a recurrent layer asked to stop inside a
        forward whose intermediate states it never got), crops to the start of that forward and
        re-feeds the kept part of it, or, with `defer_refeed`, leaves it out (`tokens` then holds
        fewer than `length`; the caller feeds the rest next). Returns the path taken: "none",
        "crop" or "refeed".
        """
        drop = len(self.tokens) - length
        if drop < 0 or length < self._committed_length:
            raise RollbackError(
                f"cannot truncate to {length} tokens: the cache holds {len(self.tokens)}, "
                f"{self._committed_length} of them committed"
            )
        path = NO_ROLLBACK
        if drop:
            try:
                self.cache.check_crop(-drop)
            except RollbackError:
                self._crop_and_refeed(length, feed=not defer_refeed)
                path = REFEED
            else:
                self.cache.crop(-drop)
                del self.tokens[length:]
                path = CROP
        self._commit()
        return path

    def _crop_and_refeed(self, length: int, feed: bool = True) -> None:
        """Crop to the start of the forward that holds token `length`, then feed the kept part again."""
        boundary = len(self.tokens)
        for size in reversed(self._step_sizes):
            if boundary <= length:
                break
            boundary -= size
        self.cache.crop(-(len(self.tokens) - boundary))  # RollbackError when even a step boundary is out of reach
        refeed = self.tokens[boundary:length]
        del self.tokens[boundary:]
        if refeed and feed:
            self.feed(refeed)
            self.refeeds += 1

    def _commit(self) -> None:
        if self._recording:  # a cache that does not record holds nothing to commit
            self.cache.crop(0)
        self._step_sizes.clear()
        self._committed_length = len(self.tokens)
