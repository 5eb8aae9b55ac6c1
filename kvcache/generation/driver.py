"""`generate`: greedy or sampled decoding with a kvcache cache, returned ready to continue.

The cache invariant: after `generate`, the cache holds every token of `sequences` but the last one
(which has not been fed to the model yet). A later call continues the conversation by passing the
whole token sequence so far (plus any new tokens) with that cache: only the tokens the cache does
not hold are fed, so `generate(model, cat(out.sequences, more), cache=out.cache)` gives what one
long call would. `max_new_tokens=0` only builds the cache of the prompt (all but its last token).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..cache import Cache
from ..encoder_decoder import EncoderDecoderCache
from ..errors import GenerationError
from ..layers.quantized_rows import rows_quantized_alone
from ..protocol import last_logits
from . import inputs
from .recovery import StreamCounter, recover, settle
from .sampling import Sampling
from .stop import DeferredStopCheck, StopCheck, is_async_device, self_attention_layers
from .streamers import Streamer


@dataclass
class GenerationOutput:
    """`sequences`: the input tokens followed by the generated ones (the decoder tokens for an
    encoder-decoder model) `[batch, seq]`; `scores`: one float32 `[batch, vocab]` tensor per
    generated step (processed logits, as transformers returns them), None unless asked for;
    `cache`: holds `sequences[:, :-1]`, ready for a continuing call."""

    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None
    cache: Cache | EncoderDecoderCache


def generate(
    model: Any,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    cache: Cache | EncoderDecoderCache | None = None,
    max_new_tokens: int,
    min_new_tokens: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    generator: torch.Generator | None = None,
    streamer: Streamer | None = None,
    output_scores: bool = False,
    defer_stop: bool | None = None,
    decoder_input_ids: torch.Tensor | None = None,
    prefix_store: Any = None,
) -> GenerationOutput:
    """Generate up to `max_new_tokens` tokens per row (see the README's Generation section).

    - `input_ids` `[batch, seq]`, left-padded with `attention_mask` (1 = token, 0 = padding) for
      batches of unequal length. With `cache`, pass the whole sequence so far: the cache's tokens
      are skipped. Encoder-decoder models take the source as `input_ids` and the decoder prefix as
      `decoder_input_ids` (default: the decoder start token).
    - A row stops at any of `eos_token_id`; it then produces `pad_token_id` (default: the first eos
      id) until every row has stopped or `max_new_tokens` is reached. Left as None, both come from
      the model when it has them (a wrapped transformers model: its `generation_config`, as in
      transformers' `generate`); `eos_token_id=[]` means no end token at all. `min_new_tokens`
      (transformers'): no end token is chosen before a row has that many new tokens (their logits
      are -inf until then).
    - `do_sample` draws with `temperature`, `top_k` (0 = off), `top_p` (1 = off) and `min_p` (0 = off)
      from `generator`. `repetition_penalty` (1 = off; transformers' meaning), greedy or sampled,
      divides the positive logits and multiplies the negative ones of every token the row holds:
      its prompt (padding excluded, so a row of a batch decodes as it would alone) and what it
      generated so far.
    - `streamer.put(tokens[batch])` receives each kept step's tokens, then `streamer.end()`.
    - `defer_stop`: read the stop decision one step late so the host never waits for the device
      (`DeferredStopCheck`); None defers on asynchronous devices (CUDA, MPS, XPU) where the cache
      can roll the extra step back exactly, True always (error when rollback cannot be exact),
      False never. The results are identical either way.
    - `prefix_store` (a `kvcache.store.PrefixStore`): start from the prompt's longest stored prefix,
      prefill the rest of its whole chunks into the store, then go on as usual (batch size 1, no
      `cache`); every chunk boundary decoding reaches is stored too, so a chat's next turn reuses
      the answer. The output equals a run without the store that prefilled the same chunks.
    """
    # ------------------------------------------------------------------ checks, before any work
    sampling = Sampling(do_sample, temperature, top_k, top_p, min_p, repetition_penalty=repetition_penalty)
    max_new_tokens = inputs.check_int("max_new_tokens", max_new_tokens, minimum=0)
    min_new_tokens = inputs.check_int("min_new_tokens", min_new_tokens, minimum=0)
    encoder_decoder = inputs.check_model(model)
    vocab = model.vocab_size
    input_ids = inputs.check_ids("input_ids", input_ids, vocab)
    attention_mask = inputs.check_mask(attention_mask, input_ids)
    batch, device = input_ids.shape[0], input_ids.device
    eos_token_id = inputs.model_default(model, "eos_token_id", eos_token_id)
    pad_token_id = inputs.model_default(model, "pad_token_id", pad_token_id)
    eos = inputs.check_token_list("eos_token_id", eos_token_id, vocab)
    pad = inputs.check_token_list("pad_token_id", pad_token_id, vocab) or eos[:1] or [0]
    if len(pad) != 1:
        raise GenerationError(f"pad_token_id must be one id, got {pad_token_id!r}")
    inputs.check_generator(generator, device)
    inputs.check_streamer(streamer)
    if defer_stop not in (None, True, False):
        raise GenerationError(f"defer_stop must be None, True or False, got {defer_stop!r}")
    if not isinstance(output_scores, bool):
        raise GenerationError(f"output_scores must be a bool, got {output_scores!r}")

    if encoder_decoder:
        if decoder_input_ids is None:
            tokens = torch.full((batch, 1), int(model.decoder_start_token_id), dtype=torch.long, device=device)
        else:
            tokens = inputs.check_ids("decoder_input_ids", decoder_input_ids, vocab)
            if tokens.shape[0] != batch or tokens.device != device:
                raise GenerationError(
                    f"decoder_input_ids {tuple(tokens.shape)} on {tokens.device} does not match input_ids "
                    f"{tuple(input_ids.shape)} on {device}"
                )
        token_mask = None  # decoder prefixes are not padded
    else:
        if decoder_input_ids is not None:
            raise GenerationError("decoder_input_ids is only for encoder-decoder models")
        tokens, token_mask = input_ids, attention_mask

    given_cache, session = cache is not None, None
    if prefix_store is not None:
        from ..store import prefill_for_generation

        cache, session = prefill_for_generation(prefix_store, model, input_ids, attention_mask, cache, encoder_decoder)
    elif cache is None:
        cache = model.new_cache()
    else:
        inputs.check_cache(cache, batch_size=batch, encoder_decoder=encoder_decoder, source_length=input_ids.shape[1])
    past, length = inputs.cache_length(cache), tokens.shape[1]
    if past >= length:
        raise GenerationError(
            f"the cache already holds {past} token(s) but the sequence has {length}: pass the whole sequence "
            "so far (e.g. the previous call's sequences plus new tokens); the cache's tokens are skipped"
        )
    layers = self_attention_layers(cache)
    if given_cache or defer_stop is True:  # a cache of the caller's, even an empty one, must fit the model
        inputs.probe_cache(model, cache, input_ids, tokens, encoder_decoder, need_rollback=defer_stop is True)
    recording_on_entry = [layer.record_past for layer in layers]
    # an empty cache's quantized layers quantize each row at its own positions (padding passed over)
    pads = [] if past or encoder_decoder else [0] * batch if token_mask is None else (token_mask == 0).sum(1).tolist()

    counter = None if streamer is None else StreamCounter(streamer)
    made: list[StopCheck] = []  # the stop check, once the prefill has made it
    with rows_quantized_alone(cache, pads) if pads else contextlib.nullcontext():  # (undone if it ends empty)
        try:
            if past > 0:  # so that an interrupted prefill can go back to what the cache held on entry
                for layer in layers:
                    layer.activate_past_recording()
            return _run(model, cache, input_ids, attention_mask, encoder_decoder, tokens, token_mask, past, length,
                        (max_new_tokens, min_new_tokens), sampling, generator, counter, output_scores, defer_stop,
                        eos, pad, recording_on_entry, made.append, session)  # fmt: skip
        except BaseException:
            stop = made[-1] if made else None
            if isinstance(stop, DeferredStopCheck) and not stop.ended and not (counter and counter.raised):
                with contextlib.suppress(Exception):  # stream the step it held back, as finishing would
                    stop.finish()
            streamed = [] if counter is None or counter.accepted == 0 else [length + counter.accepted - 1]
            recover(cache, [*streamed, past], recording_on_entry)
            raise


def _run(
    model: Any, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, encoder_decoder: bool,
    tokens: torch.Tensor, token_mask: torch.Tensor | None, past: int, length: int, new_tokens: tuple[int, int],
    sampling: Sampling, generator: torch.Generator | None, streamer: Streamer | None, output_scores: bool,
    defer_stop: bool | None, eos: list[int], pad: list[int], recording_on_entry: list[bool],
    remember: Callable[[StopCheck], None], session: Any = None,
) -> GenerationOutput:  # fmt: skip
    """The prefill and the decoding loop of `generate`, after its checks. `session`: the prefix
    store's (it is told of every forward, to store the chunk boundaries decoding reaches);
    `new_tokens`: (the most, the fewest before an end token)."""
    batch, device = tokens.shape[0], tokens.device
    max_new_tokens, min_new_tokens = new_tokens
    with torch.no_grad():
        forward = _forward_fn(model, cache, input_ids, attention_mask, encoder_decoder, session)
        positions = _positions(token_mask, past, length, max_new_tokens, batch, device)
        full_mask = None
        if token_mask is not None:
            full_mask = torch.cat([token_mask, token_mask.new_ones(batch, max_new_tokens)], dim=1)
        if max_new_tokens == 0:
            if past < length - 1:
                mask = None if full_mask is None else full_mask[:, : length - 1]
                forward(tokens[:, past : length - 1], mask, positions[:, past : length - 1], last=True)
            settle(cache, recording_on_entry)
            if streamer is not None:
                streamer.end()
            return GenerationOutput(tokens, () if output_scores else None, cache)
        mask = None if full_mask is None else full_mask[:, :length]
        logits = forward(tokens[:, past:], mask, positions[:, past:length], last=True)[:, -1]

        stop = _stop_check(cache, defer_stop, batch, device, recording_on_entry, sampling, generator, streamer)
        remember(stop)
        seen = _held_tokens(tokens, token_mask, int(logits.shape[-1])) if sampling.penalized else None
        sequences, scores = _decode(
            forward, logits, stop, sampling, generator, eos, pad[0], full_mask, positions,
            length, max_new_tokens, output_scores, seen, min_new_tokens,
        )  # fmt: skip
    if streamer is not None:
        streamer.end()
    settle(cache, recording_on_entry)
    return GenerationOutput(torch.cat([tokens, sequences], dim=1), scores, cache)


def _decode(
    forward: Callable[..., torch.Tensor],
    logits: torch.Tensor,
    stop: StopCheck,
    sampling: Sampling,
    generator: torch.Generator | None,
    eos: list[int],
    pad: int,
    full_mask: torch.Tensor | None,
    positions: torch.Tensor,
    length: int,
    max_new_tokens: int,
    output_scores: bool,
    seen: torch.Tensor | None = None,
    min_new_tokens: int = 0,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The decoding loop: no host/device sync of its own (the stop check decides about that).
    `seen` `[batch, vocab]` (bool): the tokens each row holds, for a repetition penalty; updated
    with each step's tokens."""
    device = logits.device
    need_scores = output_scores or sampling.do_sample or seen is not None
    unfinished = torch.ones(logits.shape[0], dtype=torch.bool, device=device) if eos else None
    eos_ids = torch.tensor(eos, dtype=torch.long, device=device)
    pad_id = torch.tensor(pad, dtype=torch.long, device=device)
    new_tokens: list[torch.Tensor] = []
    step_scores: list[torch.Tensor] = []
    last_step = max_new_tokens - 1
    next_tokens = pad_id.expand(logits.shape[0])  # replaced at step 0, before it is fed
    for step in range(max_new_tokens):
        if step:  # feed the previous step's token (sequence index length + step - 1)
            at = length + step
            mask = None if full_mask is None else full_mask[:, :at]
            logits = forward(next_tokens[:, None], mask, positions[:, at - 1 : at])[:, -1]
        stop.before_step()
        if step < min_new_tokens and eos:  # (before the other processing, as transformers' processor)
            logits = logits.index_fill(-1, eos_ids, float("-inf"))
        scores = sampling.scores(logits, None, seen) if need_scores else logits
        next_tokens = sampling.select(scores, generator)
        if seen is not None:
            seen.scatter_(1, next_tokens[:, None], True)
        if unfinished is not None:
            next_tokens = torch.where(unfinished, next_tokens, pad_id)
            unfinished = unfinished & ~torch.isin(next_tokens, eos_ids)
        new_tokens.append(next_tokens)
        if output_scores:
            step_scores.append(scores)
        if stop(unfinished, next_tokens, last=step == last_step):
            break
    undo = stop.finish()
    if undo:
        del new_tokens[-undo:]
        del step_scores[-undo:]
    return torch.stack(new_tokens, dim=1), tuple(step_scores) if output_scores else None


def _held_tokens(tokens: torch.Tensor, mask: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """`[batch, vocab]` bool: the tokens of each row of `tokens`, its padding (`mask` 0) left out."""
    ids = tokens if mask is None else tokens.masked_fill(mask == 0, vocab)  # padding to a column cut off
    held = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.bool, device=tokens.device)
    return held.scatter_(1, ids, True)[:, :vocab].contiguous()


def _forward_fn(
    model: Any, cache: Cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, encoder_decoder: bool,
    session: Any = None,
) -> Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]:  # fmt: skip
    """`forward(new_tokens, attention_mask, position_ids, last=False) -> logits`, appending to
    `cache` (and telling the prefix store's `session` of the tokens fed). With `last`, only the
    last position's logits are asked for where the model can skip the rest (a prefill)."""
    keep = {} if encoder_decoder else last_logits(model)
    if session is not None:
        def stored(ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor, last: bool = False) -> torch.Tensor:
            logits = model(ids, cache=cache, attention_mask=mask, position_ids=pos, **(keep if last else {}))
            session.after_forward(cache, ids)
            return logits

        return stored
    if not encoder_decoder:
        return lambda ids, mask, pos, last=False: model(ids, cache=cache, attention_mask=mask, position_ids=pos,
                                                        **(keep if last else {}))  # fmt: skip
    encoded = model.encode(input_ids, attention_mask)
    return lambda ids, mask, pos, last=False: model(
        ids, cache=cache, encoder_hidden_states=encoded, encoder_attention_mask=attention_mask,
        attention_mask=mask, position_ids=pos,
    )  # fmt: skip


def _positions(
    mask: torch.Tensor | None, past: int, length: int, max_new_tokens: int, batch: int, device: torch.device
) -> torch.Tensor:
    """Position ids `[batch, length + max_new_tokens]` of every token: padding does not count."""
    steps = torch.arange(length + max_new_tokens, device=device)
    if mask is None:
        return steps.expand(batch, -1)
    prompt = (mask.cumsum(-1) - 1).clamp(min=0)
    return torch.cat([prompt, prompt[:, -1:] + 1 + steps[:max_new_tokens]], dim=1)


def _stop_check(
    cache: Cache,
    defer_stop: bool | None,
    batch: int,
    device: torch.device,
    recording_on_entry: list[bool],
    sampling: Sampling,
    generator: torch.Generator | None,
    streamer: Streamer | None,
) -> StopCheck:
    """Pick the stop check after the prefill (recording starts only now: a long prefill into a
    sliding window or a recurrent layer must not be recorded)."""
    deferred = not (defer_stop is False or (defer_stop is None and not is_async_device(device)))
    layers = self_attention_layers(cache)
    for layer in layers:  # one step of history either way: an interrupted run is cropped back exactly
        layer.activate_past_recording()
    if not all(layer.is_croppable for layer in layers):
        if defer_stop:
            raise GenerationError("defer_stop=True: the cache cannot undo a step exactly after the prefill")
        settle(cache, recording_on_entry)
        return StopCheck(streamer)
    if not deferred:
        return StopCheck(streamer, cache=cache, commit=not any(recording_on_entry))
    if sampling.do_sample and generator is None:
        generator = _default_generator(device)
    return DeferredStopCheck(
        batch, device, cache=cache, commit=not any(recording_on_entry),
        generator=generator if sampling.do_sample else None, streamer=streamer,
    )  # fmt: skip


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator `torch.multinomial` uses when given none (so the extra step can be undone)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if generators:
        index = device.index if device.index is not None else module.current_device()
        return generators[index]
    return None
