"""What transformers' own caches cannot do, inside unmodified transformers models: exact rollback of
sliding and recurrent layers, the driver's deferred stop check, and saved caches that continue.

References are independent runs: a run that never took the rolled-back steps, the driver's
immediate stop check, transformers' own generate() with its own cache.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", minversion="5.24")

from test_transformers_models import (
    DECODE_STEPS,
    STATEFUL,
    Stepper,
    T,
    _dummy_layer_model,
    hf_cache,
    hf_generate,
    our_generate,
    prompt,
    tiny_model,
    zamba2_model,
)

from kvcache import RollbackError, SlidingWindowLayer
from kvcache.encoder_decoder import EncoderDecoderCache
from kvcache.integrations.transformers import as_transformers_cache, cache_from_config
from kvcache.persistence import load_cache, save_cache

pytestmark = pytest.mark.usefixtures("one_thread")


#: transformers 5.25 added per-token recurrent states for crops inside a forward (`recurrent_states_to_keep`).
KEEPS_RECURRENT_STATES = tuple(int(part) for part in version("transformers").split(".")[:2]) >= (5, 25)


def contents(cache: Any) -> dict[str, Any]:
    """Every tensor and every bookkeeping value of a kvcache cache, for bitwise comparison."""
    parts = (
        {"self": cache.self_attention_cache, "cross": cache.cross_attention_cache}
        if isinstance(cache, EncoderDecoderCache)
        else {"": cache}
    )
    out: dict[str, Any] = {}
    for name, part in parts.items():
        for i, layer in enumerate(part.layers):
            out[f"{name}{i}.meta"] = layer.meta_state
            out.update({f"{name}{i}.{k}": v.clone() for k, v in layer.state.items()})
    return out


def assert_same_contents(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].shape == b[key].shape and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def detour_tokens() -> torch.Tensor:
    return torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(7))


def continuation() -> torch.Tensor:
    return torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(8))


# ----------------------------------------------------------------------------- rollback
@pytest.mark.parametrize("kind", STATEFUL)
def test_crop_undoes_decode_steps_exactly(kind: str) -> None:
    """Prefill, record, decode 2 single steps and a 3-token verify step, crop(-5), continue: the logits
    and the cache equal those of a run that never took the 5 steps, bit for bit."""
    model, source = tiny_model(kind), prompt()
    detour, cont = detour_tokens(), continuation()

    ours = Stepper(model, cache_from_config(model.config), source)
    ours(source)
    ours.cache.activate_past_recording()
    ours(detour[:, :1])
    ours(detour[:, 1:2])
    ours(detour[:, 2:5])  # several tokens in one forward, as when verifying draft tokens
    assert ours.cache.is_croppable and ours.cache.max_rollback == 5
    ours.cache.crop(-5)

    never = Stepper(model, cache_from_config(model.config), source)  # the run without the detour
    never(source)
    never.cache.activate_past_recording()
    theirs = Stepper(model, hf_cache(model), source)  # and transformers' own cache, same tokens
    theirs(source)
    for i in range(cont.shape[1]):
        got = ours(cont[:, i : i + 1])
        assert torch.equal(got, never(cont[:, i : i + 1])), f"continuation step {i}"
        torch.testing.assert_close(got, theirs(cont[:, i : i + 1]), atol=1e-5, rtol=0)
    ours.cache.crop(0)  # commit both: drop the rollback history, shrink to the working size
    never.cache.crop(0)
    assert_same_contents(contents(ours.cache), contents(never.cache))


@pytest.mark.parametrize("kind", ["qwen3_next", "mamba2"])
def test_recurrent_crop_inside_a_step_is_refused_and_changes_nothing(kind: str) -> None:
    """transformers models hand over no per-token states unless the cache asks for them (>= 5.25), and a
    kvcache cache recording on its own asks for none, so a 3-token step is undone whole or not at all.
    transformers' own cache (5.24) cannot undo even that: it reports itself not croppable."""
    model, source, detour = tiny_model(kind), prompt(), detour_tokens()
    ours = Stepper(model, cache_from_config(model.config), source)
    ours(source)
    ours.cache.activate_past_recording()
    ours(detour[:, :3])
    before = contents(ours.cache)
    with pytest.raises(RollbackError):
        ours.cache.crop(-1)
    assert_same_contents(contents(ours.cache), before)
    ours.cache.crop(-3)
    assert ours.cache.max_rollback == 0

    theirs = Stepper(model, hf_cache(model), source)
    if KEEPS_RECURRENT_STATES:
        return  # transformers >= 5.25 keeps per-token states itself when asked: nothing to compare
    theirs(source)
    theirs.cache.activate_past_recording()
    theirs(detour[:, :3])
    assert not theirs.cache.is_croppable


# ------------------------------------------------------------------------ deferred stop
@pytest.mark.parametrize("kind", [*STATEFUL, "bart"])
def test_deferred_stop_gives_the_immediate_result(kind: str) -> None:
    """The deferred stop check notices the EOS one step late and rolls that step back: the same
    sequence and the same cache as the immediate check, and transformers' generate with that EOS."""
    model, source = tiny_model(kind), prompt()[:1]
    free = our_generate(model, source, max_new_tokens=DECODE_STEPS).sequences[0, -DECODE_STEPS:].tolist()
    eos = free[5]  # the run stops where this token first appears (step 5 or earlier)

    runs = {
        defer: our_generate(model, source, max_new_tokens=DECODE_STEPS, eos_token_id=eos, defer_stop=defer)
        for defer in (False, True)
    }
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    assert_same_contents(contents(runs[True].cache), contents(runs[False].cache))
    assert runs[True].sequences[0, -1] == eos and runs[True].sequences.shape[1] < source.shape[1] + DECODE_STEPS

    cache = hf_cache(model) if model.config.is_encoder_decoder else None
    expected = model.generate(source, max_new_tokens=DECODE_STEPS, do_sample=False, eos_token_id=eos, cache=cache)
    assert torch.equal(runs[False].sequences, expected)  # decoder tokens for an encoder-decoder, as transformers'


class _HostEvent:
    """What `torch.Event` does for transformers' deferred stop check on an asynchronous device, on
    the CPU (which has no events): nothing to wait for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("kind", STATEFUL)
def test_transformers_own_deferred_stop_rolls_back_a_kvcache_cache(kind: str, monkeypatch: Any) -> None:
    """transformers' `generate` with its deferred stop check (it runs on MPS; here forced on, with
    host-side events) and a kvcache cache: at an early EOS its `finish()` crops the extra step. The
    sequence and the cache equal the immediate stop check's, for every stateful kind (Falcon-H1's
    parallel hybrid layers included: their mixer and attention are updated in one forward)."""
    from transformers.generation import utils as generation_utils

    model, source = tiny_model(kind), prompt()[:1]
    free = model.generate(source, max_new_tokens=DECODE_STEPS, do_sample=False)[0, -DECODE_STEPS:].tolist()
    eos = free[5]

    def run(deferred: bool) -> tuple[torch.Tensor, Any]:
        monkeypatch.setattr(generation_utils.DeferredStopCheck, "is_supported", staticmethod(lambda *a, **k: deferred))
        cache = cache_from_config(model.config)
        out = model.generate(source, max_new_tokens=DECODE_STEPS, do_sample=False, eos_token_id=eos,
                             cache=as_transformers_cache(cache))  # fmt: skip
        return out, cache

    monkeypatch.setattr(torch, "Event", _HostEvent)
    deferred, deferred_cache = run(True)
    immediate, immediate_cache = run(False)
    assert torch.equal(deferred, immediate) and deferred[0, -1] == eos
    assert deferred.shape[1] < source.shape[1] + DECODE_STEPS
    tensors = [{k: v for k, v in contents(c).items() if isinstance(v, torch.Tensor)} for c in (deferred_cache,
                                                                                              immediate_cache)]
    assert_same_contents(*tensors)  # (the deferred run's layers were committed once more: bookkeeping only)
    more = [our_generate(model, deferred, cache=c, max_new_tokens=4, output_scores=True)
            for c in (deferred_cache, immediate_cache)]  # fmt: skip
    assert torch.equal(more[0].sequences, more[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(more[0].scores, more[1].scores, strict=True))


# -------------------------------------------------------------------------- persistence
@pytest.mark.parametrize("kind", [*STATEFUL, "bart"])
def test_saved_cache_continues_generation_identically(kind: str, tmp_path: Any) -> None:
    """Generate 10 tokens, save the cache, load it, generate 10 more: the tokens and logits of one
    uninterrupted 20-token run, and transformers' 20-token generate."""
    model, source = tiny_model(kind), prompt()
    whole = our_generate(model, source, max_new_tokens=DECODE_STEPS, output_scores=True)
    first = our_generate(model, source, max_new_tokens=10)
    path = tmp_path / f"{kind}.safetensors"
    save_cache(first.cache, path, metadata={"model": kind})
    loaded = load_cache(path)
    assert_same_contents(contents(loaded), contents(first.cache))
    if model.config.is_encoder_decoder:  # the source again, and the decoder tokens so far
        rest = our_generate(model, source, decoder_input_ids=first.sequences, cache=loaded, max_new_tokens=10,
                            output_scores=True)  # fmt: skip
    else:  # the whole sequence so far: the tokens the cache holds are skipped
        rest = our_generate(model, first.sequences, cache=loaded, max_new_tokens=10, output_scores=True)
    assert torch.equal(rest.sequences, whole.sequences) and torch.equal(rest.sequences, hf_generate(kind))
    for step, (got, expected) in enumerate(zip(rest.scores, whole.scores[10:], strict=True)):
        assert torch.equal(got, expected), f"step {10 + step}"


@pytest.mark.parametrize("kind", ["gemma3", "mamba2"])
def test_saved_recording_cache_still_rolls_back(kind: str, tmp_path: Any) -> None:
    """Rollback history travels in the file: crop(-2) on the loaded cache lands where the original would."""
    model, source, detour, cont = tiny_model(kind), prompt(), detour_tokens(), continuation()
    ours = Stepper(model, cache_from_config(model.config), source)
    ours(source)
    ours.cache.activate_past_recording()
    ours(detour[:, :1])
    ours(detour[:, 1:2])
    path = tmp_path / "recording.safetensors"
    save_cache(ours.cache, path)
    loaded = Stepper(model, load_cache(path), source)
    loaded.cache.crop(-2)
    never = Stepper(model, cache_from_config(model.config), source)
    never(source)
    for i in range(3):
        assert torch.equal(loaded(cont[:, i : i + 1]), never(cont[:, i : i + 1])), f"step {i}"


# ------------------------------------------------------------------------ speculative decoding
def test_speculative_decoding_with_stateful_transformers_models() -> None:
    """A Qwen3-Next target drafted by a Mamba2 model: rejected draft tokens are rolled back in both
    recurrent caches, and the output is the target's own greedy output (transformers refuses assisted
    generation for such models)."""
    from kvcache.generation.speculative import speculative_generate
    from kvcache.integrations.transformers import wrap_model

    target, draft = tiny_model("qwen3_next"), tiny_model("mamba2")
    source = prompt()[:1]
    out = speculative_generate(wrap_model(target), wrap_model(draft), source, num_draft_tokens=3, max_new_tokens=12,
                               draft_schedule="acceptance")  # draft at every step, whatever drafting costs
    expected = target.generate(source, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, expected)
    assert sum(out.proposed_per_step) > sum(out.accepted_per_step)  # some drafts were rejected and undone
    assert out.cache.get_seq_length() == expected.shape[1] - 1


#: A prompt fed in blocks against one forward: the blocks on a held state run the recurrences token
#: by token (Mamba1, and Mamba2 / gated delta net with per-token states) or in other chunks, and
#: every matmul and convolution runs on 9 or 7 rows instead of 23, so they may round differently.
#: Measured at 1 and 2 threads on two CPUs: on an Intel Xeon at most 1.2e-6 (Mamba2), 0 to 2.4e-7
#: for the others; on an AMD EPYC 1.8e-5 for Mamba1 (logits up to 17 in magnitude), already 4.8e-6
#: at the first token, where only the forward's length differs, and 0 in float64: rounding, not
#: state. Mamba1 mixers that scan a block from zero instead differ by more than 5.
BLOCKS_ATOL = 5e-5


@pytest.mark.parametrize("kind", ["qwen3_next", "mamba2", "mamba", "jamba", "falcon_h1", "lfm2"])
@pytest.mark.parametrize("per_token", [False, True])
def test_a_prompt_fed_in_blocks_continues_the_held_state(kind: str, per_token: bool) -> None:
    """A prompt fed in three blocks (each after the first on the states the previous left, as the
    CLI's prefill blocks, a prompt continuing a stored prefix and a verify forward are) gives the
    logits of one forward of the whole prompt, with per-token recurrence off and on."""
    from kvcache.integrations.transformers import wrap_model

    wrapped, source = wrap_model(tiny_model(kind)), prompt(length=23)
    if per_token and not wrapped.has_per_token_recurrence:
        pytest.skip("no per-token recurrence to switch on")
    whole = wrapped(source, cache=wrapped.new_cache())
    if per_token:
        wrapped.set_per_token_recurrence(True)
    try:
        cache = wrapped.new_cache()
        blocks = torch.cat([wrapped(source[:, a:b], cache=cache) for a, b in ((0, 9), (9, 16), (16, 23))], dim=1)
    finally:
        wrapped.set_per_token_recurrence(False) if per_token else None
    torch.testing.assert_close(blocks, whole, atol=BLOCKS_ATOL, rtol=0)
    assert cache.get_seq_length() == 23


@pytest.mark.parametrize("kind", ["mamba", "jamba"])
def test_prompt_lookup_on_mamba1_mixers_gives_plain_greedy_tokens(kind: str) -> None:
    """Single-sequence speculative decoding on transformers' Mamba1 mixers (Mamba, Jamba): every
    schedule gives plain greedy decoding's tokens while drafts are rejected and rolled back (their
    verify forwards used to be scanned from a zero state: other tokens from the first draft on)."""
    from kvcache.generation import PromptLookupDrafter, speculative_generate
    from kvcache.integrations.transformers import wrap_model

    model = tiny_model(kind)
    source = prompt()[:1].repeat(1, 3)  # repetitive: the drafter finds candidates
    expected = model.generate(source, max_new_tokens=24, do_sample=False)
    for schedule in ("adaptive", "constant", "acceptance"):
        out = speculative_generate(wrap_model(model), PromptLookupDrafter(), source, max_new_tokens=24,
                                   num_draft_tokens=4, draft_schedule=schedule)  # fmt: skip
        assert torch.equal(out.sequences, expected), schedule
        if schedule == "constant":
            assert sum(out.proposed_per_step) > sum(out.accepted_per_step)  # drafts rejected and undone


#: One-token forwards take the decode kernels (the conv window's update, the single-step state
#: update), the whole prompt the conv and the scan: measured at 1 and 2 threads, at most 8.7e-5
#: on logits up to 16.6 (Mamba) and 7.2e-5 (Jamba); a chunk scanned from zero differs by more than 5.
ONE_BY_ONE_ATOL = 1e-3


@pytest.mark.parametrize("kind", ["mamba", "jamba"])
def test_mamba1_chunks_go_token_by_token_where_transformers_cannot_be_asked(kind: str, monkeypatch: Any) -> None:
    """Where transformers' Mamba1 mixers do not ask the cache for per-token states (before 5.25,
    simulated here), `wrap_model` feeds a chunk on a held state one token per forward: blocks give
    one forward's logits, and single and batched prompt lookup give plain greedy tokens."""
    import kvcache.integrations.hf_models as hf_models
    from kvcache.generation import PromptLookupDrafter, generate, speculative_generate
    from kvcache.integrations.transformers import wrap_model

    monkeypatch.setattr(hf_models, "asks_for_states", lambda model: False)
    model = tiny_model(kind)
    wrapped, source = wrap_model(model), prompt(length=23)
    assert wrapped._one_by_one
    whole = wrapped(source, cache=wrapped.new_cache())
    cache = wrapped.new_cache()
    blocks = torch.cat([wrapped(source[:, a:b], cache=cache) for a, b in ((0, 9), (9, 16), (16, 23))], dim=1)
    torch.testing.assert_close(blocks, whole, atol=ONE_BY_ONE_ATOL, rtol=0)
    repeated = prompt()[:1].repeat(1, 3)
    expected = model.generate(repeated, max_new_tokens=16, do_sample=False)
    out = speculative_generate(wrapped, PromptLookupDrafter(), repeated, max_new_tokens=16, draft_schedule="constant")
    assert torch.equal(out.sequences, expected)
    batch = prompt(batch=3, length=10, seed=4)
    plain = generate(wrapped, batch, max_new_tokens=12).sequences
    out = speculative_generate(wrapped, PromptLookupDrafter(), batch, max_new_tokens=12, draft_schedule="constant")
    assert torch.equal(out.sequences, plain)


def test_conv_only_layers_roll_back_to_any_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """LFM2's short-conv layers hold a conv window and no recurrent state, so a crop may land inside
    a multi-token forward: feed 3 tokens, crop(-1), and every layer holds exactly what that 3-token
    forward computed for its first 2 tokens (bitwise, against a plain run of the same forward)."""
    from kvcache.layers.recurrent import RecurrentLayer

    model, source, detour, cont = tiny_model("lfm2"), prompt(), detour_tokens(), continuation()
    ours = Stepper(model, cache_from_config(model.config), source)
    ours(source)
    ours.cache.activate_past_recording()
    ours(detour[:, :3])
    ours.cache.crop(-1)

    ref = Stepper(model, cache_from_config(model.config), source)  # never records
    ref(source)
    conv_layers = [i for i, layer in enumerate(ref.cache.layers) if isinstance(layer, RecurrentLayer)]
    assert conv_layers
    before = {i: ref.cache.get_conv_state(i).clone() for i in conv_layers}
    fed: dict[int, torch.Tensor] = {}
    plain_update = RecurrentLayer.update_conv_state

    def capture(layer: RecurrentLayer, inputs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        fed[ref.cache.layers.index(layer)] = inputs.clone()
        return plain_update(layer, inputs, *args, **kwargs)

    monkeypatch.setattr(RecurrentLayer, "update_conv_state", capture)
    ref(detour[:, :3])
    monkeypatch.setattr(RecurrentLayer, "update_conv_state", plain_update)
    for i in conv_layers:
        kernel = before[i].shape[-1]
        expected = torch.cat([before[i], fed[i][..., :2]], dim=-1)[..., -kernel:]
        assert torch.equal(ours.cache.get_conv_state(i), expected), f"layer {i}"
    for i, layer in enumerate(ref.cache.layers):
        if layer.has_attention:
            assert torch.equal(ours.cache.layers[i].keys, layer.keys[:, :, :-1]), f"layer {i}"
            assert torch.equal(ours.cache.layers[i].values, layer.values[:, :, :-1]), f"layer {i}"

    # A run that fed only 2 tokens computed them in a 2-row forward, not a 3-row one, so its states
    # differ in the last bits (measured: 7e-9 in logits); continuing agrees to rounding, same tokens.
    never = Stepper(model, cache_from_config(model.config), source)
    never(source)
    never(detour[:, :2])
    assert ours.cache.get_seq_length() == never.cache.get_seq_length()
    for i in range(3):
        got, want = ours(cont[:, i : i + 1]), never(cont[:, i : i + 1])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"step {i}: {m}")
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", ["qwen3_next", "mamba2", "mamba", "jamba"])
def test_transformers_prompt_lookup_crops_inside_a_recurrent_forward(kind: str) -> None:
    """transformers >= 5.25 runs prompt lookup on recurrent models: it asks the cache how many
    per-token states a verify forward should hand over and crops inside that forward. Through the
    adapter they become the step's `intermediate_states`, so every crop lands on a known state and
    the output is plain greedy decoding's, with drafts rejected on the way. Tokens, not logits, are
    compared: the verify forward computes its last states token by token, plain decoding in chunks
    (other rounding). transformers' own cache does not get there on Mamba2 (5.25: it diverges at
    token 22 of this run; its crop of N tokens returns to the state before the whole forward)."""
    model = tiny_model(kind)
    if not KEEPS_RECURRENT_STATES:
        pytest.skip("transformers < 5.25 keeps no per-token recurrent states")
    source = prompt()[:1].repeat(1, 3)  # repetitive: the prompt-lookup drafter finds candidates
    kv = cache_from_config(model.config)
    crops: list[int] = []
    plain_crop = type(kv).crop

    def spy(self: Any, tokens_to_remove: Any) -> None:
        crops.append(int(tokens_to_remove))
        plain_crop(self, tokens_to_remove)

    type(kv).crop = spy  # type: ignore[method-assign]
    try:
        ours = model.generate(source, max_new_tokens=40, do_sample=False, cache=as_transformers_cache(kv),
                              prompt_lookup_num_tokens=3)
    finally:
        type(kv).crop = plain_crop  # type: ignore[method-assign]
    plain = model.generate(source, max_new_tokens=40, do_sample=False)
    assert torch.equal(ours, plain)
    assert any(n < 0 for n in crops), "no draft was rejected: the test exercised nothing"


@pytest.mark.parametrize("kind", ["gemma3", "lfm2"])
@pytest.mark.parametrize("how", ["prompt_lookup", "assistant_model"])
def test_transformers_assisted_decoding_keeps_layers_at_working_size(kind: str, how: str) -> None:
    """transformers' own assisted / prompt-lookup loops start recording through the adapter and only
    ever undo part of the last forward: the adapter then keeps one forward of history, so over 60
    generated tokens a sliding layer holds at most W - 1 + (draft + 1) tokens and a conv layer at most
    kernel + (draft + 1) columns after the prefill (before: every generated token stayed). The output
    is transformers' own."""
    import copy

    model, draft = tiny_model(kind), 3
    source = prompt()[:1].repeat(1, 3)  # repetitive: the prompt-lookup drafter finds candidates
    extra = {"prompt_lookup_num_tokens": draft} if how == "prompt_lookup" else {"assistant_model": copy.deepcopy(model)}
    if how == "assistant_model":
        extra["assistant_model"].generation_config.num_assistant_tokens = draft
        extra["assistant_model"].generation_config.num_assistant_tokens_schedule = "constant"
    kv = cache_from_config(model.config)
    held: list[list[int]] = []
    plain_forward = type(model).forward

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = plain_forward(self, *args, **kwargs)
        if self is model:
            held.append([_held(layer) for layer in kv.layers])
        return out

    type(model).forward = spy
    try:
        ours = model.generate(source, max_new_tokens=60, do_sample=False, cache=as_transformers_cache(kv), **extra)
    finally:
        type(model).forward = plain_forward
    theirs = model.generate(source, max_new_tokens=60, do_sample=False, **extra)
    assert torch.equal(ours, theirs)
    assert len(held) > 10
    for i, layer in enumerate(kv.layers):
        if isinstance(layer, SlidingWindowLayer) or layer.has_recurrent:
            limit = (layer.sliding_window - 1 if layer.has_attention else layer.meta_state["slots"][0]["kernel"])
            peak = max(step[i] for step in held[1:])  # after the prefill
            assert peak <= limit + draft + 1, (i, peak)


def _held(layer: Any) -> int:
    meta = layer.meta_state
    if "kept_length" in meta:
        return meta["kept_length"]
    return meta["slots"][0]["conv_columns"] if "slots" in meta else 0


# -------------------------------------------------------------- batched speculative decoding
class _RowSteered:
    """A wrapped transformers model as a draft: "always" agrees with the target, "never" moves its
    greedy choice to the next token id everywhere, "sometimes" where position plus batch row is a
    multiple of 3, so rows of one batch accept different numbers of draft tokens in one step."""

    def __init__(self, wrapped: Any, agree: str) -> None:
        self.wrapped, self.agree = wrapped, agree
        self.vocab_size = wrapped.vocab_size
        self.is_encoder_decoder = False
        self.new_cache = wrapped.new_cache
        self.has_per_token_recurrence = wrapped.has_per_token_recurrence
        self.set_per_token_recurrence = wrapped.set_per_token_recurrence

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        logits = self.wrapped(input_ids, **kwargs)
        if self.agree == "always":
            return logits
        rows = torch.arange(input_ids.shape[0])[:, None]
        move = ((kwargs["position_ids"] + rows) % 3 == 0)[..., None] | (self.agree == "never")
        return torch.where(move, logits.roll(1, dims=-1), logits)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral", "qwen3_next", "mamba2", "mamba", "jamba", "falcon_h1",
                                  "nemotron_h"])  # fmt: skip
@pytest.mark.parametrize("batch", [2, 4, 8])
def test_batched_speculative_decoding_equals_transformers_batched_generate(kind: str, batch: int) -> None:
    """Left-padded rows of different lengths, k = 1, 3, 5, drafts that agree always, never and
    sometimes: row for row the tokens of transformers' own batched greedy generate() (with its own
    cache), while rows accept different counts and the kvcache cache is cropped per row (Gemma3:
    sliding and full layers get one mask each; Qwen3-Next and Mamba2, target and draft: their
    recurrent mixers run per token inside verify forwards). Each row's tokens also equal
    transformers' generate() of that row alone: batched and single-row kernels round differently
    (float32), but not by enough to change a greedy choice of these models."""
    from kvcache.generation import ModelDrafter, speculative_generate
    from kvcache.integrations.transformers import wrap_model

    if kind in ("falcon_h1", "nemotron_h") and not KEEPS_RECURRENT_STATES:
        pytest.skip("these mixers hand over per-token states from transformers 5.25 on")
    model = _dummy_layer_model(kind) if kind == "nemotron_h" else tiny_model(kind)  # (Nemotron-H: an MLP layer)
    source = prompt(batch=batch, length=10, seed=3)
    mask = torch.ones_like(source)
    for b in range(batch):
        mask[b, : (3 * b) % 7] = 0  # rows 0..6 tokens shorter, left-padded
    source = source.masked_fill(mask == 0, 0)
    expected = model.generate(source, attention_mask=mask, max_new_tokens=12, do_sample=False)
    for b in range(batch):
        alone = model.generate(source[b : b + 1, mask[b].bool()], max_new_tokens=12, do_sample=False)
        assert torch.equal(alone[0, -12:], expected[b, -12:]), f"row {b}"
    wrapped = wrap_model(model)
    ragged = 0
    for agree in ("always", "never", "sometimes"):
        for k in (1, 3, 5):
            out = speculative_generate(wrapped, ModelDrafter(_RowSteered(wrapped, agree)), source,
                                       attention_mask=mask, num_draft_tokens=k, max_new_tokens=12)  # fmt: skip
            assert torch.equal(out.sequences, expected), f"{agree}, k={k}"
            rates = {"always": [1.0] * batch, "never": [0.0] * batch}
            assert agree == "sometimes" or out.acceptance_rates == rates[agree]
            steps = min(len(a) for a in out.accepted_per_step)
            ragged += sum(len({a[s] for a in out.accepted_per_step}) > 1 for s in range(steps))
    assert ragged > 0


def _unmaskable(kind: str) -> Any:
    """A tiny model whose rows cannot be masked at different lengths: Bloom (ALiBi from a 2-D
    padding mask) or Llama4 text (chunked attention)."""
    torch.manual_seed(0)
    if kind == "bloom":
        model = T.BloomForCausalLM(T.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4,
                                                 initializer_range=0.3))  # fmt: skip
    else:
        model = T.Llama4ForCausalLM(T.Llama4TextConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
            interleave_moe_layer_step=2, attention_chunk_size=8))  # fmt: skip
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model.eval()


@pytest.mark.parametrize("kind", ["bloom", "llama4"])
def test_batched_speculation_refuses_models_that_cannot_mask_ragged_rows_before_any_forward(kind: str) -> None:
    """Rows accept different counts, and a model that cannot mask rows of different lengths (Bloom
    built its ALiBi from a 2-D mask and failed with a ValueError at the first ragged forward) is
    refused with the reason before anything is computed; one row at a time it speculates and gives
    plain greedy tokens, and plain batched decoding is unaffected."""
    from kvcache import GenerationError
    from kvcache.generation import PromptLookupDrafter, generate, speculative_generate
    from kvcache.integrations.transformers import wrap_model

    model = _unmaskable(kind)
    wrapped, source = wrap_model(model), prompt(batch=2).repeat(1, 2)
    calls: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with pytest.raises(GenerationError, match="cannot mask"):
            speculative_generate(wrapped, PromptLookupDrafter(), source, max_new_tokens=8)
        assert calls == []
    finally:
        hook.remove()
    plain = generate(wrapped, source, max_new_tokens=8).sequences
    assert torch.equal(plain, model.generate(source, max_new_tokens=8, do_sample=False))
    for row in range(2):
        one = speculative_generate(wrapped, PromptLookupDrafter(), source[row : row + 1], max_new_tokens=8,
                                   draft_schedule="constant")  # fmt: skip
        assert torch.equal(one.sequences, plain[row : row + 1])


def test_per_token_recurrence_is_switched_off_again_and_refused_without_mixers() -> None:
    """After a batched run the mixers run their own multi-token path again (no instance forward
    left behind); a model without recurrent mixers has no such switch."""
    from kvcache.errors import CacheInputError
    from kvcache.generation import PromptLookupDrafter, speculative_generate
    from kvcache.integrations.hf_recurrence import recurrent_mixers
    from kvcache.integrations.transformers import wrap_model

    wrapped = wrap_model(tiny_model("mamba2"))
    speculative_generate(wrapped, PromptLookupDrafter(), prompt(), max_new_tokens=4)
    mixers = recurrent_mixers(wrapped.model)
    assert mixers and all("forward" not in vars(m) for m in mixers)
    with pytest.raises(CacheInputError, match="no recurrent mixer"):
        wrap_model(tiny_model("llama")).set_per_token_recurrence(True)
    from kvcache import GenerationError  # a recurrent mixer of another class: refused, not cropped wrongly

    with pytest.raises(GenerationError, match="per-token recurrent states from the target"):
        speculative_generate(wrap_model(zamba2_model()), PromptLookupDrafter(), prompt(), max_new_tokens=4)


def test_a_ragged_cache_inside_unwrapped_transformers_code_is_refused_not_masked_wrongly() -> None:
    """transformers' own mask functions place every row's queries at one position; handed a cache
    whose rows differ in length (a per-row crop), the adapter refuses to size those masks. Through
    `wrap_model` the same forward gets per-row masks and matches a cache that never held the
    cropped tokens."""
    from kvcache.errors import CacheInputError
    from kvcache.integrations.transformers import wrap_model

    model, source = tiny_model("llama"), prompt(batch=2, length=8)
    cache = cache_from_config(model.config)
    with torch.no_grad():
        model(source, cache=as_transformers_cache(cache), use_cache=True)
        cache.crop(torch.tensor([0, -3]))
        with pytest.raises(CacheInputError, match="different numbers of tokens"):
            model(source[:, :1], cache=as_transformers_cache(cache), use_cache=True)
        got = wrap_model(model)(source[:, :1], cache=cache, position_ids=torch.tensor([[8], [5]]))
        for row, kept in ((0, 8), (1, 5)):
            alone = cache_from_config(model.config)
            model(source[row : row + 1, :kept], cache=as_transformers_cache(alone), use_cache=True)
            want = model(source[row : row + 1, :1], cache=as_transformers_cache(alone), use_cache=True).logits
            torch.testing.assert_close(got[row : row + 1], want, atol=1e-5, rtol=0)  # batched vs one row
