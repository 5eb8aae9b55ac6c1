"""Batched speculative decoding: every row accepts its own number of draft tokens and the caches
are cropped per row. Greedy output equals, row for row, batched plain greedy decoding of the same
left-padded batch and each row decoded alone; the sampling rule holds per row; errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_speculative import VOCAB, SteeredDraft, make_target

from kvcache import GenerationError
from kvcache.generation import ModelDrafter, PromptLookupDrafter, generate, speculative_generate
from kvcache.generation.drafters import Draft, Drafter
from kvcache.models.decoder import DecoderConfig, DecoderLM
from kvcache.models.hybrid import HybridConfig, HybridLM

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 15
KINDS = ["full", "sliding", "hybrid", "encoder_decoder"]


class RowSteeredDraft(SteeredDraft):
    """`SteeredDraft` that also hands its per-token recurrent states over (batched rollback of a
    recurrent draft model needs them, as the target's does). "sometimes" disagrees where position
    plus batch row is a multiple of 3, so rows at the same positions (encoder-decoder decoders all
    start together) still accept different counts."""

    def __init__(self, target: torch.nn.Module, agree: str) -> None:
        super().__init__(target, agree)
        if hasattr(self.model, "set_return_intermediate_states"):
            self.set_return_intermediate_states = self.model.set_return_intermediate_states
            self.modules = self.model.modules

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.agree != "sometimes":
            return super().__call__(input_ids, **kwargs)
        logits = self.model(input_ids, **kwargs)
        rows = torch.arange(input_ids.shape[0])[:, None]
        move = ((kwargs["position_ids"] + rows) % 3 == 0)[..., None]
        return torch.where(move, logits.roll(1, dims=-1), logits)


@pytest.fixture(scope="module")
def targets():
    # seed 4 for the encoder-decoder: seed 0's decoder repeats one token whatever the source
    return {kind: make_target(kind, seed=4 if kind == "encoder_decoder" else 0) for kind in KINDS}


def padded_batch(batch: int, seed: int, encoder_decoder: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` prompts of different lengths (3 to 9 tokens), left-padded with zeros."""
    g = torch.Generator().manual_seed(seed)
    lengths = [3 + (5 * b + seed) % 7 for b in range(batch)]
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (batch, width), generator=g)
    mask = torch.ones(batch, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, : width - n] = 0
        ids[b, : width - n] = 0
    return ids, mask


def new_tokens(sequences: torch.Tensor, width: int, eos: int | None = None) -> list[list[int]]:
    """Each row's tokens after the prompt, cut after its first eos."""
    rows = []
    for row in sequences[:, width:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row)
    return rows


def reference(target, ids, mask, encoder_decoder: bool, eos: int | None = None):
    """Batched plain greedy decoding, and each row decoded alone (its own prompt, no padding)."""
    width = 1 if encoder_decoder else ids.shape[1]
    plain = generate(target, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos)
    batched = new_tokens(plain.sequences, width, eos)
    alone = []
    for b in range(ids.shape[0]):
        row = ids[b : b + 1, mask[b].bool()]
        out = generate(target, row, max_new_tokens=NEW, eos_token_id=eos)
        alone.append(new_tokens(out.sequences, 1 if encoder_decoder else row.shape[1], eos)[0])
    return batched, alone


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [2, 4, 8])
def test_greedy_equals_batched_plain_decoding_and_each_row_alone(targets, kind, batch):
    """For k = 1, 3, 5 and drafts that agree always, never and sometimes (every third position,
    so rows accept different counts in the same step). The models are float64 with sharpened
    logits: batched and single-row kernels round differently (~1e-15), far below the gap between
    the best two logits, so tokens must be identical."""
    target = targets[kind]
    encoder_decoder = kind == "encoder_decoder"
    ids, mask = padded_batch(batch, seed=batch, encoder_decoder=encoder_decoder)
    batched, alone = reference(target, ids, mask, encoder_decoder)
    assert batched == alone
    width = 1 if encoder_decoder else ids.shape[1]
    ragged_steps = 0
    for agree, k in itertools.product(["always", "never", "sometimes"], [1, 3, 5]):
        out = speculative_generate(target, ModelDrafter(RowSteeredDraft(target, agree)), ids, attention_mask=mask,
                                   num_draft_tokens=k, max_new_tokens=NEW)  # fmt: skip
        assert new_tokens(out.sequences, width) == batched, (agree, k)
        assert out.num_new_tokens == [NEW] * batch
        rates = out.acceptance_rates
        if agree == "always":
            assert rates == [1.0] * batch
        elif agree == "never":
            assert rates == [0.0] * batch
        steps = min(len(a) for a in out.accepted_per_step)
        ragged_steps += sum(len({a[s] for a in out.accepted_per_step}) > 1 for s in range(steps))
    assert ragged_steps > 0  # rows did accept different counts in one step


@pytest.mark.parametrize("kind", KINDS)
def test_rows_stop_at_their_own_eos(targets, kind):
    """An eos that some rows produce early: those rows stop (and leave the batch), the others go
    on, and every row ends where batched plain decoding ends it."""
    target = targets[kind]
    encoder_decoder = kind == "encoder_decoder"
    ids, mask = padded_batch(4, seed=3, encoder_decoder=encoder_decoder)
    width = 1 if encoder_decoder else ids.shape[1]
    free = new_tokens(generate(target, ids, attention_mask=mask, max_new_tokens=NEW).sequences, width)
    def ends(t: int) -> list[int]:
        return [row.index(t) + 1 if t in row else NEW for row in free]

    # an eos that stops rows at different points (some early, some late or never)
    eos = max(range(VOCAB), key=lambda t: (len(set(ends(t))), -min(ends(t))))
    batched, alone = reference(target, ids, mask, encoder_decoder, eos=eos)
    assert batched == alone and len({len(r) for r in batched}) > 1
    out = speculative_generate(target, ModelDrafter(RowSteeredDraft(target, "sometimes")), ids, attention_mask=mask,
                               num_draft_tokens=3, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)  # fmt: skip
    assert new_tokens(out.sequences, width, eos) == batched
    assert out.num_new_tokens == [len(r) for r in batched]
    for b, row in enumerate(batched):  # padding after a row's end
        assert out.sequences[b, width + len(row) :].eq(0).all()


@pytest.mark.parametrize("kind", ["full", "sliding", "hybrid"])
def test_prompt_lookup_per_row(targets, kind):
    """Each row drafts from its own text: repetitive prompts of different lengths."""
    target = targets[kind]
    rows = [[1, 2, 3, 4] * 3, [5, 6, 7] * 2, [8, 9, 10, 11, 12] * 2 + [8, 9]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    batched, alone = reference(target, ids, mask, False)
    out = speculative_generate(target, PromptLookupDrafter(max_ngram_size=2), ids, attention_mask=mask,
                               num_draft_tokens=4, max_new_tokens=NEW)  # fmt: skip
    assert new_tokens(out.sequences, width) == batched == alone
    assert sum(map(sum, out.proposed_per_step)) > 0


def test_one_padded_row_takes_the_batched_path(targets):
    """Batch size 1 with padding decodes as its unpadded row does."""
    target = targets["sliding"]
    ids, mask = padded_batch(2, seed=5, encoder_decoder=False)
    ids, mask = ids[1:], mask[1:]
    assert not bool(mask.all())
    out = speculative_generate(target, ModelDrafter(RowSteeredDraft(target, "sometimes")), ids, attention_mask=mask,
                               num_draft_tokens=3, max_new_tokens=NEW)  # fmt: skip
    alone = generate(target, ids[:, mask[0].bool()], max_new_tokens=NEW).sequences[0, -NEW:].tolist()
    assert out.new_tokens == [alone]


def test_bad_batched_inputs_raise(targets):
    target = targets["hybrid"]
    ids, mask = padded_batch(3, seed=1, encoder_decoder=False)
    drafter = ModelDrafter(RowSteeredDraft(target, "always"))
    right_padded = mask.flip(1)
    with pytest.raises(GenerationError, match="left padding"):
        speculative_generate(target, drafter, ids, attention_mask=right_padded, max_new_tokens=4)
    with pytest.raises(GenerationError, match="cache= is for batch size 1"):
        speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=4, cache=target.new_cache())
    with pytest.raises(GenerationError, match="per-token recurrent states from the target"):
        speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=4, intermediate_states=False)
    with pytest.raises(GenerationError, match="per-token recurrent states from the draft model"):
        speculative_generate(target, ModelDrafter(SteeredDraft(target, "always")), ids, attention_mask=mask,
                             max_new_tokens=4)  # fmt: skip
    assert not any(m.return_intermediate_states for m in target.modules() if hasattr(m, "return_intermediate_states"))


# ----------------------------------------------------------------------------- sampling rule
def _tiny(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    small = {"vocab_size": 4, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "num_kv_heads": 1}
    if kind == "hybrid":
        model = HybridLM(HybridConfig(**small, recurrent_heads=1, recurrent_key_dim=8, recurrent_value_dim=8,
                                      sliding_window=4))  # fmt: skip
    else:
        model = DecoderLM(DecoderConfig(**small, layer_types=["full_attention", "sliding_attention"], sliding_window=3))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8)  # spread, not peaked: every outcome keeps some probability
    return model.double().eval()


def _exact(model, prompt: list[int], n: int, temperature: float) -> dict[tuple[int, ...], float]:
    """P(next n tokens = s) for every s, from uncached full-sequence forwards of each prefix."""
    probs = {}
    for seq in itertools.product(range(4), repeat=n):
        p = 1.0
        for i in range(n):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq[:i])]))[0, -1]
            p *= float((logits / temperature).softmax(-1)[seq[i]])
        probs[seq] = p
    return probs


def _chi2(counts: dict, expected: dict, runs: int) -> tuple[float, float]:
    from scipy.stats import chi2

    big = [s for s, p in expected.items() if p * runs >= 5]
    small = [s for s in expected if s not in big]
    observed = [counts.get(s, 0) for s in big] + [sum(counts.get(s, 0) for s in small)]
    wanted = [expected[s] * runs for s in big] + [sum(expected[s] for s in small) * runs]
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    statistic = sum((o - w) ** 2 / w for o, w in zip(observed, wanted, strict=True))
    return statistic, chi2.ppf(0.999, len(wanted) - 1)


@pytest.mark.parametrize(("kind", "temperature"), [("full", 1.0), ("hybrid", 0.8)])
def test_sampling_rule_holds_per_row(kind, temperature):
    """Chi-square goodness of fit, per prompt, of the first 3 sampled tokens (64 outcomes) over 500
    samples against that prompt's exact target distribution, at significance 0.001. A batch holds
    each of 3 prompts (of different lengths, left-padded) 5 times; its rows sample independently
    and accept different counts; 100 seeded batches. Power: the draft model's own distribution
    fails the same test clearly for some prompt."""
    target, draft = _tiny(kind, 1), _tiny(kind, 2)
    prompts, n, copies, runs = [[1, 3], [2, 0, 1, 1], [3]], 3, 5, 100
    rows = [p for p in prompts for _ in range(copies)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in rows])[:, None]).long()
    generator = torch.Generator().manual_seed(99)
    counts: list[dict] = [{} for _ in prompts]
    accepted = proposed = 0
    for _ in range(runs):
        out = speculative_generate(target, ModelDrafter(draft), ids, attention_mask=mask, num_draft_tokens=2,
                                   max_new_tokens=n, do_sample=True, temperature=temperature,
                                   generator=generator)  # fmt: skip
        for row, tokens in enumerate(out.new_tokens):
            seen = counts[row // copies]
            seen[tuple(tokens)] = seen.get(tuple(tokens), 0) + 1
        accepted += sum(map(sum, out.accepted_per_step))
        proposed += sum(map(sum, out.proposed_per_step))
    runs *= copies  # samples per prompt
    assert 0 < accepted < proposed
    worst_draft = 0.0
    for b, prompt in enumerate(prompts):
        expected = _exact(target, prompt, n, temperature)
        statistic, bound = _chi2(counts[b], expected, runs)
        assert statistic < bound, f"row {b}: chi2 {statistic:.1f} >= {bound:.1f}"
        draft_dist = _exact(draft, prompt, n, temperature)
        wrong = {s: p * runs for s, p in draft_dist.items()}
        worst_draft = max(worst_draft, _chi2(wrong, expected, runs)[0] / bound)
    assert worst_draft > 5


def test_generate_refuses_a_ragged_cache(targets):
    """`generate` positions every row from one length: a cache whose rows differ is an error."""
    target = targets["full"]
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache()
    with torch.no_grad():
        target(ids[:, :5], cache=cache)
    cache.crop(torch.tensor([0, -2]))
    with pytest.raises(GenerationError, match="different numbers of tokens"):
        generate(target, ids, cache=cache, max_new_tokens=2)
    assert cache.get_seq_lengths().tolist() == [5, 3]


def test_a_self_drafted_batch_leaves_the_model_as_it_found_it(targets, monkeypatch):
    """`speculative_generate(model, model, batch)`: the target's and the draft's switches are undone
    in reverse order, so `return_intermediate_states` ends as it began (False), after a normal run
    and after an interruption (Ctrl-C) inside the loop; later plain runs take the normal path."""
    from kvcache.generation import speculative_batch

    model = targets["hybrid"]
    flags = [m for m in model.modules() if hasattr(m, "return_intermediate_states")]
    assert flags and not any(m.return_intermediate_states for m in flags)
    ids, mask = padded_batch(2, 0, False)
    speculative_generate(model, model, ids, attention_mask=mask, max_new_tokens=4)
    assert not any(m.return_intermediate_states for m in flags)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(speculative_batch, "_loop", interrupted)
    with pytest.raises(KeyboardInterrupt):
        speculative_generate(model, model, ids, attention_mask=mask, max_new_tokens=4)
    assert not any(m.return_intermediate_states for m in flags)
    monkeypatch.undo()
    cache = model.new_cache()  # a plain forward records one state per step, as before any speculation
    cache.activate_past_recording()
    with torch.no_grad():
        model(ids[:1, :4], cache=cache)
    assert not any(step.inter is not None for layer in cache for slot in getattr(
        getattr(layer, "recurrent", layer), "_slots", []) for step in slot.steps)


class FixedDrafter(Drafter):
    """Proposes `token` again and again (a match of 3 tokens, it says): wrong wherever the target
    never picks `token`."""

    reports_match = True

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, sequence, num_tokens, pick):
        return Draft([self.token] * num_tokens, match=3)


def test_a_greedy_batch_stops_feeding_drafts_that_never_pay(targets):
    """Greedy rows with a drafter that is not a model share the measured gate (as a server's batch
    does): drafts that are never right are soon fed no more (a plain step and a few one-token
    tries), where the acceptance schedule feeds every row at least one draft token a step. The
    tokens are plain decoding's either way."""
    target = targets["full"]
    ids, mask = padded_batch(4, seed=3, encoder_decoder=False)
    plain = generate(target, ids, attention_mask=mask, max_new_tokens=40)
    produced = set(plain.sequences[:, ids.shape[1]:].flatten().tolist())
    never = next(t for t in range(VOCAB) if t not in produced)
    fed = {}
    for schedule in ("adaptive", "acceptance"):
        out = speculative_generate(target, FixedDrafter(never), ids, attention_mask=mask, num_draft_tokens=4,
                                   max_new_tokens=40, draft_schedule=schedule)  # fmt: skip
        assert torch.equal(out.sequences, plain.sequences)
        steps = list(zip(*out.proposed_per_step, strict=True))  # a wrong draft: one token a step, 40 steps
        fed[schedule] = sum(1 for step in steps if any(step))
        assert len(steps) == 40
    assert fed["acceptance"] == 39 and fed["adaptive"] <= 5, fed  # (the last step has no room for a draft)
