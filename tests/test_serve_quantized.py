"""The server's engine on quantized caches (`kvcache serve --kv-bits`): every request is quantized
exactly as when it runs alone (`QuantizedRows`: each row its own layer, blocks at its own
positions), so under concurrency, with and without speculation, and from the prefix store, each
greedy answer equals the prompt decoded alone with the same quantized cache. The bundled model in
float64, as the other engine tests (batched and single-row kernels differ in the last bits only)."""

from __future__ import annotations

import pytest
import torch
from test_serve_engine import alone, prompt_ids, run_requests, serve_greedy

from kvcache.generation.sampling import Sampling
from kvcache.layers.quantized import QuantizedLayer
from kvcache.layers.quantized_rows import QuantizedRows
from kvcache.models import load_default_model
from kvcache.serve.engine import Engine, Request
from kvcache.store import PrefixStore
from kvcache.store.quant_payloads import QuantDelta

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def quantized():
    model, tokenizer = load_default_model(dtype=torch.float64)
    model.kv_bits = 4
    return model, tokenizer


@pytest.mark.parametrize("speculative", [0, 4], ids=["plain", "speculative"])
def test_answers_equal_each_prompt_alone_with_the_same_quantized_cache(quantized, speculative: int) -> None:
    """8 prompts of 9 to 200 tokens at once (rows of every padding, so blocks would fall apart in a
    shared layer), then the same prompts again (hits on the quantized chunks stored the first time):
    every answer is the prompt decoded alone through a quantized cache."""
    model, tokenizer = quantized
    assert isinstance(model.new_cache().layers[0], QuantizedLayer)
    store = PrefixStore(chunk_size=16)
    engine = Engine(model, store, eos=[], speculative=speculative, max_step_tokens=128,
                    draft_schedule="constant")  # every draft verified, whatever the timing
    batches = []
    original = engine._join

    def join() -> None:  # the batch's attention layers, as the engine lays them out
        original()
        batches.append(engine._cache.layers[0])

    engine._join = join
    engine.start()
    try:
        prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((9, 40, 200, 77, 16, 130, 33, 95))]
        for _ in range(2):
            requests = [Request(prompt=p, max_tokens=40, sampling=Sampling(False)) for p in prompts]
            outcomes = run_requests(engine, requests)
            for prompt, request, outcome in zip(prompts, requests, outcomes, strict=True):
                assert outcome.events[-1] == ("done", "length")
                assert request.tokens == alone(model, prompt, 40)
        assert sum(r.cached_tokens for r in requests) >= sum(len(p) // 16 * 16 - 16 for p in prompts)
    finally:
        engine.stop()
    assert batches and all(isinstance(layer, QuantizedRows) for layer in batches)
    assert any(len(set(layer.pads)) > 2 for layer in batches)  # rows of different paddings were batched


def test_quantized_store_entries_hold_quantized_chunks(quantized) -> None:
    """Entries the server stores for a quantized model are quantized chunks (no full-precision
    token at a 16-token boundary), well under the size of the full-precision model's entries."""
    model, tokenizer = quantized
    sizes = {}
    for bits in (4, None):
        model.kv_bits = bits
        try:
            store = PrefixStore(chunk_size=16)
            engine = Engine(model, store, eos=[])
            engine.start()
            try:
                run_requests(engine, [Request(prompt=prompt_ids(tokenizer, 3, 96), max_tokens=4,
                                              sampling=Sampling(False))])  # fmt: skip
            finally:
                engine.stop()
            entries = list(store.backend.entries().values())
            sizes[bits] = sum(e.nbytes for e in entries) / len(entries)
            if bits:
                for entry in entries:
                    assert all(isinstance(p, QuantDelta) and p.residual_k.shape[2] == 0 for p in entry.payloads)
        finally:
            model.kv_bits = 4
    assert sizes[4] <= 0.35 * sizes[None]


@pytest.mark.parametrize("kind", ["llama", "gemma3", "lfm2", "falcon_h1"])
def test_transformers_models_are_served_quantized_as_alone(kind: str) -> None:
    """Llama (full attention), Gemma3 (quantized sliding windows too), LFM2 (short convolutions
    between attention layers) and Falcon-H1 (attention and Mamba under one layer index) wrapped with
    `kv_bits=4`, served with prompt-lookup speculation: each greedy answer equals the prompt decoded
    alone through the same quantized cache (Falcon-H1's Mamba states handed over token by token
    from transformers 5.25 on; without speculation before)."""
    pytest.importorskip("transformers", minversion="5.24")
    from test_transformers_models import tiny_model
    from test_transformers_rollback import KEEPS_RECURRENT_STATES

    from kvcache.generation import generate
    from kvcache.integrations.transformers import wrap_model

    model = wrap_model(tiny_model(kind).double(), kv_bits=4)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 40, 23, 70)]
    prompts = [p + p[:20] for p in prompts]  # some repetition: drafts get accepted
    speculative = 0 if kind == "falcon_h1" and not KEEPS_RECURRENT_STATES else 3
    engine = Engine(model, PrefixStore(chunk_size=16), eos=[], speculative=speculative, draft_schedule="constant")
    requests, _ = serve_greedy(engine, prompts, 24)
    for prompt, request in zip(prompts, requests, strict=True):
        ids = torch.tensor([prompt])
        assert request.tokens == generate(model, ids, max_new_tokens=24).sequences[0, len(prompt) :].tolist()


def test_a_quantized_prompt_is_one_forward_and_stores_every_boundary_it_passed(quantized) -> None:
    """A 201-token prompt into a quantized cache is prefilled in one forward (its quantized layers
    record it, so every boundary inside it can still be taken; the forward computes all its blocks
    at once), stores all 12 boundaries, and each holds the codes a prefill of one 16-token forward
    per chunk stores there (float64: equal); the answer is the prompt decoded alone."""
    from test_serve_engine import CountingModel

    model, tokenizer = quantized
    prompt = prompt_ids(tokenizer, 3, 201)
    counting = CountingModel(model)
    store = PrefixStore(chunk_size=16)
    requests, _ = serve_greedy(Engine(counting, store, eos=[], max_step_tokens=512), [prompt], 3)
    assert requests[0].tokens == alone(model, prompt, 3)
    assert [s for s in counting.fed if s[1] > 1] == [(1, 201)]
    assert store.stats.chunks_inserted == 12
    chunked = PrefixStore(chunk_size=16)
    chunked.prefill(model, prompt)  # one forward per chunk, each boundary taken at its forward's end
    for boundary in (16, 112, 192):
        reused, got = store.lookup(prompt[: boundary + 1], counting)
        assert reused == boundary and chunked.lookup(prompt[: boundary + 1], model)[0] == boundary
        want = chunked.lookup(prompt[: boundary + 1], model)[1]
        for ours, theirs in zip(got, want, strict=True):
            assert ours.state.keys() == theirs.state.keys()
            assert all(torch.equal(ours.state[name], theirs.state[name]) for name in ours.state), boundary
