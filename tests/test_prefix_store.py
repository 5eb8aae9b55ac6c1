"""`PrefixStore`: prompts that hit the store continue exactly as a run that prefilled the same
chunks, for every layer kind (reference models and transformers families); the longest stored
prefix wins; different models never share entries; the byte budget is a hard bound."""

from __future__ import annotations

import random

import pytest
import torch

from kvcache import CacheInputError, GenerationError
from kvcache.generation import PromptLookupDrafter, generate, speculative_generate
from kvcache.models import DecoderConfig, DecoderLM, HybridConfig, HybridLM
from kvcache.store import PrefixStore

pytestmark = pytest.mark.usefixtures("one_thread")
CHUNK = 8


def reference(kind: str) -> DecoderLM:
    torch.manual_seed(0)
    if kind == "full":
        return DecoderLM(DecoderConfig(layer_types=["full_attention", "full_attention"])).eval()
    if kind == "sliding":  # a window narrower than a chunk: kept as the window at each boundary
        return DecoderLM(DecoderConfig(layer_types=["sliding_attention", "full_attention"], sliding_window=6)).eval()
    if kind == "wide_sliding":  # wider than a chunk: kept as per-chunk keys/values, the window rebuilt from them
        return DecoderLM(DecoderConfig(layer_types=["sliding_attention", "full_attention"], sliding_window=20)).eval()
    return HybridLM(HybridConfig()).eval()  # recurrent, full, parallel hybrid and sliding layers


def chunked_prefill(model, tokens: list[int], upto: int):
    """The independent reference: a fresh cache fed `tokens[:upto]` chunk by chunk."""
    cache = model.new_cache()
    with torch.no_grad():
        for start in range(0, upto, CHUNK):
            ids = torch.tensor([tokens[start : start + CHUNK]])
            model(ids, cache=cache, position_ids=torch.arange(start, start + ids.shape[1])[None])
    return cache


def assert_same_layers(a, b) -> None:
    assert [type(x) for x in a] == [type(y) for y in b]
    for x, y in zip(a, b, strict=True):
        assert x.meta_state == y.meta_state
        sa, sb = x.state, y.state
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ["full", "sliding", "wide_sliding", "hybrid"])
def test_a_hit_continues_exactly_as_the_chunked_prefill(kind: str) -> None:
    model = reference(kind)
    store = PrefixStore(chunk_size=CHUNK)
    prompt = torch.randint(1, 256, (1, 37), generator=torch.Generator().manual_seed(1))
    plain = generate(model, prompt, max_new_tokens=12, output_scores=True)
    cold = generate(model, prompt, max_new_tokens=12, output_scores=True, prefix_store=store)
    # 37 tokens: 4 whole chunks prefilled (the rest the driver feeds), then the 2 boundaries decoding
    # reaches (40 and 48 tokens held)
    assert store.stats.hits == 0 and store.stats.chunks_inserted == 6
    hit = generate(model, prompt, max_new_tokens=12, output_scores=True, prefix_store=store)
    assert store.stats.hits == 1 and store.stats.tokens_reused == 32
    assert hit.sequences.tolist() == cold.sequences.tolist() == plain.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(hit.scores, cold.scores, strict=True))  # the same computation
    # against one-shot prefill, chunking changes the reduction order: the logits agree within round-off
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(hit.scores, plain.scores, strict=True))
    # the rebuilt cache is the chunked prefill's, layer by layer, bit for bit
    matched, cache = store.lookup(prompt[0].tolist(), model)
    assert matched == 32
    assert_same_layers(cache, chunked_prefill(model, prompt[0].tolist(), 32))


def test_the_longest_stored_prefix_is_chosen_and_shares_nothing() -> None:
    model = reference("hybrid")
    store = PrefixStore(chunk_size=CHUNK)
    base = torch.randint(1, 256, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    store.prefill(model, base[:20])  # 2 chunks
    store.prefill(model, base[:50])  # 6 chunks, sharing the first 2
    assert len(store) == 6  # the shared chunks are stored once
    for length, want in ((60, 48), (45, 40), (17, 16), (9, 8), (7, 0)):
        matched, cache = store.lookup(base[:length], model)
        assert matched == want
        if matched:
            assert_same_layers(cache, chunked_prefill(model, base, matched))
    other = [*base[:16], (base[16] + 1) % 256, *base[17:40]]  # diverges inside chunk 3
    assert store.lookup(other, model)[0] == 16
    matched, cache = store.lookup(base, model)
    held = [t.clone() for layer in cache for t in layer.state.values()]
    for layer in cache:  # scribble on what the store handed out
        for t in layer.state.values():
            t.add_(1.0) if t.is_floating_point() else None
    again = store.lookup(base, model)[1]
    again_held = [t for layer in again for t in layer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(again_held, held, strict=True))


def test_models_never_exchange_entries() -> None:
    a, b = reference("full"), reference("sliding")
    bigger = DecoderLM(DecoderConfig(layer_types=["full_attention", "full_attention"], hidden_size=128)).eval()
    store = PrefixStore(chunk_size=CHUNK)
    tokens = list(range(1, 30))
    store.prefill(a, tokens)
    assert store.lookup(tokens, a)[0] == 24
    assert store.lookup(tokens, b)[0] == 0  # other layer kinds
    assert store.lookup(tokens, bigger)[0] == 0  # same kinds, other shapes
    assert PrefixStore(chunk_size=CHUNK, namespace="fine-tune").lookup(tokens, a)[0] == 0


def test_chunk_keys_chain_each_chunks_int64_tokens_onto_the_previous_key() -> None:
    """A chunk's key is xxh3-128 of the previous key (the model's root for the first) and its
    tokens as little-endian int64: what servers on other machines and earlier versions compute,
    so they share entries. Keys extended as a request grows equal keys computed at once."""
    import struct

    import xxhash

    model = reference("full")
    store = PrefixStore(chunk_size=CHUNK)
    tokens = [random.Random(2).randrange(256) for _ in range(45)]
    session = store.session(model)
    expected, parent = [], session.root
    for start in range(0, len(tokens) - CHUNK + 1, CHUNK):
        parent = xxhash.xxh3_128_digest(parent + struct.pack(f"<{CHUNK}q", *tokens[start : start + CHUNK]))
        expected.append(parent)
    assert store.chunk_keys(model, tokens) == expected and len(expected) == 5
    session.tokens = tokens[:19]
    session.extend_keys()
    session.tokens = tokens
    session.extend_keys()
    assert session.keys == expected


def test_a_memory_entry_is_checked_against_the_model_once(monkeypatch) -> None:
    """The memory backend hands the same entries to every lookup: a hit checks each one against
    the model the first time (its payloads, per layer) and not again at the same depth of the same
    model, with the same cache rebuilt; an entry met anywhere else (another root or depth) is
    checked again, and one that fails is dropped."""
    from kvcache.store import session as session_module

    model = reference("hybrid")
    store = PrefixStore(chunk_size=CHUNK)
    tokens = list(range(1, 30))
    store.prefill(model, tokens)
    calls = []
    real = session_module.check_payload
    monkeypatch.setattr(session_module, "check_payload", lambda *a: calls.append(a[2]) or real(*a))
    first = store.lookup(tokens, model)
    layers = len(model.new_cache().layers)
    assert first[0] == 24 and sorted(set(calls)) == [1, 2, 3] and len(calls) == 3 * layers
    again = store.lookup(tokens, model)
    assert len(calls) == 3 * layers and again[0] == 24  # nothing checked twice
    assert_same_layers(again[1], first[1])
    entries = store.backend.entries()
    moved = next(e for e in entries.values() if e.parent is None)
    moved.checked = (b"another model", 0)
    assert store.lookup(tokens, model)[0] == 24 and len(calls) == 4 * layers  # the first chunk checked again
    moved.checked, moved.payloads = None, moved.payloads[:-1]  # damaged since: found and dropped
    with pytest.warns(UserWarning, match="does not fit the model"):
        assert store.lookup(tokens, model)[0] == 0


def _tensor_bytes(store: PrefixStore) -> int:
    """Bytes of the distinct tensors the store holds, measured from the tensors themselves."""
    seen, total = set(), 0
    for entry in store.backend.entries().values():
        for payload in entry.payloads:
            parts = [payload]
            while parts:
                p = parts.pop()
                if hasattr(p, "attention"):
                    parts += [p.attention, p.recurrent]
                    continue
                for t in ([p.keys, p.values] if hasattr(p, "keys") else list(p.state.values())):
                    if t.data_ptr() not in seen:
                        seen.add(t.data_ptr())
                        total += t.nbytes
    return total


def test_the_budget_is_a_hard_bound_under_a_random_workload() -> None:
    model = reference("hybrid")
    chunk_bytes = PrefixStore(chunk_size=CHUNK).prefill(model, list(range(1, 10)))[1]  # warm-up only
    del chunk_bytes
    probe = PrefixStore(chunk_size=CHUNK)
    probe.prefill(model, list(range(1, 18)))
    budget = int(probe.nbytes * 2.5)  # room for about 5 chunks
    store = PrefixStore(chunk_size=CHUNK, max_bytes=budget)
    rng = random.Random(3)
    systems = [[rng.randrange(1, 256) for _ in range(16)] for _ in range(2)]
    for step in range(40):
        prompt = rng.choice(systems) + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 20))]
        if rng.random() < 0.3:
            prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(9, 40))]  # unrelated
        if rng.random() < 0.5:
            store.prefill(model, prompt)
        else:
            matched, cache = store.lookup(prompt, model)
            assert matched % CHUNK == 0
            if matched and step % 5 == 0:  # a hit continues exactly; a miss is an empty cache
                assert_same_layers(cache, chunked_prefill(model, prompt, matched))
            elif not matched:
                assert cache.get_seq_length() == 0
        measured = _tensor_bytes(store)
        assert measured == store.nbytes <= budget, (step, measured, store.nbytes, budget)
    assert store.stats.evictions > 0 and store.stats.hits > 0
    # every stored chunk's whole prefix is stored too (eviction goes leaves first)
    for entry in store.backend.entries().values():
        assert entry.parent is None or entry.parent in store.backend.entries()


def test_eviction_takes_the_least_recently_used_leaf() -> None:
    model = reference("full")
    probe = PrefixStore(chunk_size=CHUNK)
    probe.prefill(model, list(range(1, 10)))
    store = PrefixStore(chunk_size=CHUNK, max_bytes=4 * probe.nbytes)  # room for 4 chunks
    a, b, c = ([k * 30 + i for i in range(17)] for k in (1, 2, 3))
    store.prefill(model, a)
    store.prefill(model, b)
    assert len(store) == 4
    store.lookup(a, model)  # a is now more recently used than b
    store.prefill(model, c)  # needs 2 chunks: b's leaf, then b's root go (leaves first)
    assert [store.lookup(x, model)[0] for x in (a, b, c)] == [16, 0, 16]
    assert store.stats.evictions == 2 and store.nbytes <= store.max_bytes


def test_speculative_generate_uses_the_store() -> None:
    model = reference("hybrid")
    store = PrefixStore(chunk_size=CHUNK)
    prompt = torch.randint(1, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    plain = generate(model, prompt, max_new_tokens=10)
    for _ in range(2):
        out = speculative_generate(model, PromptLookupDrafter(), prompt, max_new_tokens=10, prefix_store=store)
        assert out.sequences.tolist() == plain.sequences.tolist()
    assert store.stats.hits == 1 and store.stats.tokens_reused == 24


def test_bad_arguments_are_clear_errors_and_change_nothing() -> None:
    model = reference("full")
    store = PrefixStore(chunk_size=CHUNK)
    store.prefill(model, list(range(1, 20)))
    before = (len(store), store.nbytes)
    for kwargs in ({"chunk_size": 0}, {"max_bytes": -1}, {"chunk_size": True}, {"namespace": 3}):
        with pytest.raises(CacheInputError):
            PrefixStore(**kwargs)
    for tokens in ([1.5, 2], "abc", torch.ones(2, 3, dtype=torch.long), [True, 1], [1, 256], [-1]):
        with pytest.raises(CacheInputError):
            store.lookup(tokens, model)
        with pytest.raises(CacheInputError):
            store.prefill(model, tokens)
    for kwargs in ({"keep_last": 0}, {"keep_last": 1.0}):
        with pytest.raises(CacheInputError, match="keep_last"):
            store.prefill(model, list(range(1, 20)), **kwargs)
    with pytest.raises(CacheInputError, match="max_tokens"):
        store.lookup(list(range(1, 20)), model, max_tokens=-1)
    static = DecoderLM(DecoderConfig(layer_types=["full_attention"]))
    static.new_cache = lambda: static.new_static_cache(64)  # a model whose cache is fixed-size
    with pytest.raises(CacheInputError, match="static"):
        store.prefill(static, list(range(1, 20)))
    with pytest.raises(GenerationError, match="batch size 1"):
        generate(model, torch.ones(2, 9, dtype=torch.long), max_new_tokens=2, prefix_store=store)
    with pytest.raises(GenerationError, match="without cache"):
        generate(model, torch.ones(1, 9, dtype=torch.long), max_new_tokens=2, prefix_store=store,
                 cache=model.new_cache())  # fmt: skip
    with pytest.raises(GenerationError, match="PrefixStore"):
        generate(model, torch.ones(1, 9, dtype=torch.long), max_new_tokens=2, prefix_store={})
    assert (len(store), store.nbytes) == before


@pytest.mark.parametrize("kind", ["full", "sliding", "wide_sliding", "hybrid"])
def test_decoding_stores_its_chunk_boundaries_exactly(kind: str) -> None:
    """Every boundary decoding reaches is stored, and the cache a lookup rebuilds there is, layer
    by layer and bit for bit, the cache of an independent run that prefilled the prompt in chunks
    and decoded the same tokens up to that boundary."""
    model, store = reference(kind), PrefixStore(chunk_size=CHUNK)
    prompt = torch.randint(1, 256, (1, 13), generator=torch.Generator().manual_seed(2))
    out = generate(model, prompt, max_new_tokens=30, prefix_store=store)
    tokens = out.sequences[0].tolist()  # the cache held 42 tokens: boundaries up to 40
    matched, cache = store.lookup(tokens, model)
    assert matched == 40 and store.stats.chunks_inserted == 5
    reference_cache = chunked_prefill(model, tokens, 8)  # the prompt's whole chunk, as the store's prefill fed it
    generate(model, prompt, cache=reference_cache, max_new_tokens=40 - 13 + 1)  # decodes up to 40 held tokens
    for layer in reference_cache:
        layer.record_past = False
    assert reference_cache.get_seq_length() == 40
    from kvcache.store.payloads import canonical

    assert_same_layers(cache, [canonical(layer) for layer in reference_cache])


def _counting(model):
    """`model`, counting the tokens of its multi-token forwards (prefill; decoding feeds one at a time)."""
    fed = []
    real = model.forward

    def forward(ids, **kwargs):
        if ids.shape[1] > 1:
            fed.append(ids.shape[1])
        return real(ids, **kwargs)

    model.forward = forward
    return fed


@pytest.mark.parametrize("which", ["bundled", "hybrid"])
def test_a_three_turn_chat_prefills_only_the_last_chunk_and_the_new_message(which: str) -> None:
    """Turn n's prompt is turn n-1's prompt, its answer and a new message. With a store, turns 2
    and 3 prefill at most one chunk plus the new message (the answers' chunks were stored while
    decoding), and every turn's output equals the run without a store."""
    chunk = 16
    if which == "bundled":
        from kvcache.models import load_default_model

        model, tokenizer = load_default_model()
        encode = tokenizer.encode
        messages = ["User: What does the cache hold?\nAssistant:", "\nUser: And after a crop?\nAssistant:",
                    "\nUser: Why is that exact?\nAssistant:"]  # fmt: skip
    else:
        model = reference("hybrid")
        encode = lambda text: [ord(c) for c in text]  # noqa: E731
        messages = ["first message, a long one, " * 2, " a second message ", " and a third "]
    store = PrefixStore(chunk_size=chunk)
    fed = _counting(model)
    history: list[int] = []
    for turn, message in enumerate(messages):
        new = encode(message)
        ids = torch.tensor([history + new])
        plain = generate(model, ids, max_new_tokens=40)
        fed.clear()
        reused = store.stats.tokens_reused
        out = generate(model, ids, max_new_tokens=40, prefix_store=store)
        reused = store.stats.tokens_reused - reused
        assert out.sequences.tolist() == plain.sequences.tolist(), f"turn {turn + 1}"
        probe = chunk if turn == 1 else 0  # the first hit checks entries against one forward of a chunk, once
        assert sum(fed) <= ids.shape[1] - reused + probe, (turn, fed)  # nothing is fed twice
        if turn:
            assert ids.shape[1] - reused <= chunk + len(new), (turn, reused, ids.shape[1], len(new))
        history = out.sequences[0].tolist()
    assert store.stats.hits == 2


transformers = pytest.importorskip("transformers", minversion="5.24")


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral", "qwen3_next", "mamba2", "mamba", "jamba", "falcon_h1"])
def test_transformers_families_hit_the_store_exactly(kind: str) -> None:
    from test_transformers_models import tiny_model

    from kvcache.integrations.transformers import wrap_model

    model = wrap_model(tiny_model(kind))
    store = PrefixStore(chunk_size=CHUNK)
    prompt = torch.randint(1, 128, (1, 29), generator=torch.Generator().manual_seed(5))
    plain = generate(model, prompt, max_new_tokens=8, output_scores=True)
    cold = generate(model, prompt, max_new_tokens=8, output_scores=True, prefix_store=store)
    hit = generate(model, prompt, max_new_tokens=8, output_scores=True, prefix_store=store)
    assert store.stats.tokens_reused == 24
    assert hit.sequences.tolist() == cold.sequences.tolist() == plain.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(hit.scores, cold.scores, strict=True))
