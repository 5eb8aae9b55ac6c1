"""The server's engine in-process (no HTTP): prefill blocks under a token budget, the chunks they
store, the store's background writer, and one request's failure kept to that request.

The bundled model in float64 (batched and single-row kernels differ in the last bits only, far
below the logit gaps: greedy tokens must be identical to the prompt decoded alone).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from kvcache import CacheInputError
from kvcache.generation import generate
from kvcache.generation.sampling import Sampling
from kvcache.layers.sliding import SlidingWindowLayer
from kvcache.models import load_default_model
from kvcache.serve.engine import Engine, Request
from kvcache.serve.prefill import IDLE_STEP_TOKENS
from kvcache.store import PrefixStore, open_store

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bundled():
    return load_default_model(dtype=torch.float64)


def prompt_ids(tokenizer, i: int, length: int) -> list[int]:
    text = "".join(f"The value {i} of the list is {i * 7 % 13}. " for _ in range(length // 20 + 1))
    return tokenizer.encode(text)[:length]


def alone(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    return generate(model, ids, max_new_tokens=n).sequences[0, len(prompt) :].tolist()


@dataclass
class Outcome:
    events: list
    done: threading.Event


def run_requests(engine: Engine, requests: list[Request], timeout: float = 120) -> list[Outcome]:
    outcomes = []
    for request in requests:
        outcome = Outcome([], threading.Event())

        def sink(event, outcome=outcome):
            outcome.events.append(event)
            if event[0] in ("done", "error"):
                outcome.done.set()

        request.on_event = sink
        outcomes.append(outcome)
    for request in requests:
        engine.submit(request)
    for outcome in outcomes:
        assert outcome.done.wait(timeout), "the engine did not answer"
    return outcomes


def serve_greedy(engine: Engine, prompts: list[list[int]], n: int) -> tuple[list[Request], list[Outcome]]:
    """Start `engine`, have it answer greedy requests of `n` tokens for `prompts` (sent together),
    stop it: the requests and their outcomes."""
    engine.start()
    try:
        requests = [Request(prompt=p, max_tokens=n, sampling=Sampling(False)) for p in prompts]
        return requests, run_requests(engine, requests)
    finally:
        engine.stop()


class CountingModel:
    """The model, counting the tokens each forward feeds (the engine's budget is checked with it)."""

    def __init__(self, model) -> None:
        self.inner, self.fed = model, []
        self.engine: Engine | None = None  # when set: `busy` notes, per forward, whether rows were decoding
        self.busy: list[bool] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, ids, **kwargs):
        self.fed.append(tuple(ids.shape))
        if self.engine is not None:
            self.busy.append(bool(self.engine._rows or self.engine._ready))
        return self.inner(ids, **kwargs)


@pytest.mark.parametrize("budget", [16, 100, 512])
def test_answers_equal_each_prompt_alone_under_every_budget(bundled, budget: int) -> None:
    """Prompts of 10 to 300 tokens arriving together: each forward while rows decode feeds at
    most the budget (a first block at least a chunk), one while none does at most the idle
    budget, prefill blocks end on chunk boundaries unless they end the prompt, and every greedy
    answer equals its prompt decoded alone."""
    model, tokenizer = bundled
    counting = CountingModel(model)
    store = PrefixStore(chunk_size=16)
    engine = Engine(counting, store, eos=[], max_step_tokens=budget)
    counting.engine = engine
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((10, 47, 300, 129, 64))]
    requests, outcomes = serve_greedy(engine, prompts, 12)
    for prompt, request, outcome in zip(prompts, requests, outcomes, strict=True):
        assert outcome.events[-1] == ("done", "length")
        assert request.tokens == alone(model, prompt, 12)
    prefills = [(s, busy) for s, busy in zip(counting.fed, counting.busy, strict=True) if s[0] == 1 and s[1] > 1]
    assert prefills and any(busy for _, busy in prefills)
    assert all(s[1] <= max(budget, 16 if busy else IDLE_STEP_TOKENS) for s, busy in prefills)
    if budget >= 300:  # the longest prompt went in one block, not in chunks
        assert (1, 300) in [s for s, _ in prefills]


def test_a_cold_prompt_while_nothing_decodes_is_one_forward(bundled) -> None:
    """With no row decoding, nothing waits on a long block: a lone cold 1,000-token prompt is fed
    in one forward (the default budget would cut it in four), every chunk of it stored, and the
    answer equals the prompt decoded alone."""
    model, tokenizer = bundled
    counting = CountingModel(model)
    store = PrefixStore(chunk_size=16)
    prompt = prompt_ids(tokenizer, 7, 1000)
    requests, outcomes = serve_greedy(Engine(counting, store, eos=[]), [prompt], 4)
    assert outcomes[0].events[-1] == ("done", "length")
    assert requests[0].tokens == alone(model, prompt, 4)
    assert [s for s in counting.fed if s[1] > 1] == [(1, 1000)]
    matched, _ = store.lookup(prompt, counting)  # the engine's model: the store keys what it serves
    assert matched == 1000 // 16 * 16


def test_block_prefill_stores_every_boundary_as_the_forward_computed_it(bundled) -> None:
    """A 200-token prompt fed as one block stores all 12 chunk boundaries inside it; the cache a
    lookup rebuilds at each boundary holds exactly (bitwise) the keys/values the block's forward
    computed for those positions, the sliding windows included (they record the block, so the
    chunks they evict are still taken)."""
    model, tokenizer = bundled
    prompt = prompt_ids(tokenizer, 3, 201)
    store = PrefixStore(chunk_size=16)
    engine = Engine(model, store, eos=[], max_step_tokens=512)
    engine.start()
    try:
        run_requests(engine, [Request(prompt=prompt, max_tokens=1, sampling=Sampling(False))])
    finally:
        engine.stop()
    assert store.stats.chunks_inserted == 12
    reference = model.new_cache()  # the same forward, every window recording: it keeps every token
    reference.activate_past_recording()
    model(torch.tensor([prompt[:200]]), cache=reference, position_ids=torch.arange(200)[None])
    for boundary in (16, 112, 192):
        reused, cache = store.lookup(prompt[: boundary + 1], model)
        assert reused == boundary
        for got, want in zip(cache, reference, strict=True):
            keys, values = want.state["keys"], want.state["values"]
            held = got.state["keys"].shape[2]
            if isinstance(got, SlidingWindowLayer):
                assert held == min(got.sliding_window - 1, boundary)
            assert torch.equal(got.state["keys"], keys[:, :, boundary - held : boundary])
            assert torch.equal(got.state["values"], values[:, :, boundary - held : boundary])


class FailingSampling(Sampling):
    def scores(self, logits, counts=None, seen=None):  # a row whose sampling breaks (a bug, a bad parameter)
        raise RuntimeError("probability tensor contains nan")


def test_one_requests_failure_never_reaches_another(bundled) -> None:
    """A row whose sampling fails ends alone with an error; the rows decoded with it finish with
    their own greedy answers, and the engine takes new requests after."""
    model, tokenizer = bundled
    engine = Engine(model, PrefixStore(chunk_size=16), eos=[])
    engine.start()
    try:
        prompts = [prompt_ids(tokenizer, i, 30 + i) for i in range(4)]
        requests = [Request(prompt=p, max_tokens=20, sampling=Sampling(False)) for p in prompts]
        requests[2].sampling = FailingSampling(True, 1.0)
        outcomes = run_requests(engine, requests)
        late = Request(prompt=prompts[0], max_tokens=5, sampling=Sampling(False))
        run_requests(engine, [late])
    finally:
        engine.stop()
    assert outcomes[2].events[-1][0] == "error" and "nan" in outcomes[2].events[-1][1]
    for i in (0, 1, 3):
        assert requests[i].tokens == alone(model, prompts[i], 20), i
    assert late.tokens == alone(model, prompts[0], 5)
    assert engine.active == {"waiting": 0, "prefilling": 0, "running": 0, "batch_cache": 0}


class WriterWatchingModel(CountingModel):
    """The model, noting for each forward whether the store's writer may run inserts meanwhile."""

    def __init__(self, model, store) -> None:
        super().__init__(model)
        self.store, self.writer_running = store, []

    def __call__(self, ids, **kwargs):
        self.writer_running.append((ids.shape[1], self.store.writer._running.is_set()))
        return super().__call__(ids, **kwargs)


def test_a_directory_store_writes_on_its_background_writer(bundled, tmp_path) -> None:
    """With a directory store the engine's inserts go through the store's writer: a cold prompt's
    chunks are all written once the writer is flushed, and the same prompt then hits them. The
    writer is paused while prompts prefill (a cold prompt's first token does not pay for encoding
    its chunks) and never during decode steps."""
    model, tokenizer = bundled
    store = open_store(str(tmp_path / "store"), chunk_size=16)
    watching = WriterWatchingModel(model, store)
    engine = Engine(watching, store, eos=[])
    engine.start()
    prompt = prompt_ids(tokenizer, 5, 150)
    try:
        assert store.writer is not None
        first = Request(prompt=prompt, max_tokens=3, sampling=Sampling(False))
        run_requests(engine, [first])
        store.writer.flush(30)
        second = Request(prompt=prompt, max_tokens=3, sampling=Sampling(False))
        run_requests(engine, [second])
    finally:
        engine.stop()
    assert store.writer is None  # stopped with the engine, its queue finished
    assert first.cached_tokens == 0 and second.cached_tokens == 144
    prefills = [running for width, running in watching.writer_running if width > 1]
    decodes = [running for width, running in watching.writer_running if width == 1]
    assert prefills and not any(prefills)
    assert decodes and all(decodes)
    assert first.tokens == second.tokens == alone(model, prompt, 3)


def test_a_full_writer_skips_chunks_and_never_the_decode(bundled, tmp_path) -> None:
    """A writer whose queue takes nothing: the chunks are skipped (counted), the answers are the
    prompt's own, and nothing half-written is found later."""
    model, tokenizer = bundled
    store = open_store(str(tmp_path / "store"), chunk_size=16)
    engine = Engine(model, store, eos=[])
    engine.start()
    store.writer.max_bytes = 0  # every insert is refused...
    store.writer._bytes = 1  # ...as if the queue held something already
    prompt = prompt_ids(tokenizer, 6, 90)
    try:
        request = Request(prompt=prompt, max_tokens=20, sampling=Sampling(False))
        run_requests(engine, [request])
        skipped = store.writer.skipped
        store.writer._bytes = 0
    finally:
        engine.stop()
    assert skipped >= 1 and request.tokens == alone(model, prompt, 20)
    assert store.lookup(prompt, model)[0] == 0


@pytest.mark.parametrize("draft", ["the model itself", "an unrelated model"])
def test_a_draft_model_gives_each_prompt_its_own_answer(bundled, draft: str) -> None:
    """`Engine(draft_model=)`: eight concurrent greedy requests, each drafting with the draft
    model on a cache of its own, verified together and cropped row by row, answer what each
    prompt decoded alone answers. With the model as its own draft every draft is accepted, so
    the target runs verify forwards of several tokens and fewer forwards than tokens."""
    from kvcache.models import DecoderLM

    model, tokenizer = bundled
    if draft == "the model itself":
        drafter = model
    else:
        torch.manual_seed(5)
        drafter = DecoderLM(model.config).double().eval()
    counting = CountingModel(model)
    engine = Engine(counting, PrefixStore(chunk_size=16), eos=[], speculative=3, draft_model=drafter)
    engine.start()
    try:
        prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((10, 47, 90, 33, 64, 21, 55, 17))]
        requests = [Request(prompt=p, max_tokens=20, sampling=Sampling(False)) for p in prompts]
        run_requests(engine, requests)
    finally:
        engine.stop()
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.tokens == alone(model, prompt, 20), prompt[:10]
    steps = [s for s in counting.fed if s[1] <= 4]  # decode/verify steps (every prefill forward is longer)
    assert any(s[0] > 1 and s[1] > 1 for s in steps)  # drafts of several rows verified together
    if draft == "the model itself":  # 19 steps without drafting; every draft kept
        assert len(steps) < 12, steps


def test_a_draft_model_of_another_vocabulary_or_an_unknown_schedule_is_refused(bundled) -> None:
    from kvcache.models import DecoderConfig, DecoderLM

    model, _ = bundled
    other = DecoderLM(DecoderConfig(vocab_size=model.vocab_size + 1)).double().eval()
    with pytest.raises(CacheInputError, match="vocabulary"):
        Engine(model, PrefixStore(chunk_size=16), eos=[], speculative=3, draft_model=other)
    with pytest.raises(CacheInputError, match="speculative"):
        Engine(model, PrefixStore(chunk_size=16), eos=[], draft_model=model)
    with pytest.raises(CacheInputError, match="draft_schedule must be"):
        Engine(model, PrefixStore(chunk_size=16), eos=[], speculative=3, draft_schedule="acceptance")
    for bad in (-1, 2.0, True, "4"):
        with pytest.raises(CacheInputError, match="speculative must be an int >= 0"):
            Engine(model, PrefixStore(chunk_size=16), eos=[], speculative=bad)


def test_suffix_drafting_learns_from_finished_requests_and_changes_no_answer(bundled) -> None:
    """`Engine(suffix_corpus=)`: eight concurrent requests answer as each prompt alone; each
    finished request feeds the shared corpus, so the same prompts sent again are drafted from the
    first answers: far fewer target forwards, the same answers."""
    from kvcache.generation import SuffixCorpus

    model, tokenizer = bundled
    corpus = SuffixCorpus()
    counting = CountingModel(model)
    engine = Engine(counting, PrefixStore(chunk_size=16), eos=[], speculative=8, suffix_corpus=corpus,
                    draft_schedule="constant")  # every draft fed: the count of steps does not hang on timing
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((10, 47, 90, 33, 64, 21, 55, 17))]
    engine.start()
    try:
        rounds = []
        for _ in range(2):
            before = len(counting.fed)
            requests = [Request(prompt=p, max_tokens=24, sampling=Sampling(False)) for p in prompts]
            run_requests(engine, requests)
            rounds.append((requests, [s for s in counting.fed[before:] if s[1] <= 9]))  # decode/verify steps
    finally:
        engine.stop()
    for requests, _ in rounds:
        for prompt, request in zip(prompts, requests, strict=True):
            assert request.tokens == alone(model, prompt, 24), prompt[:10]
    assert len(corpus) == 16  # every finished request was fed
    first_steps, second_steps = len(rounds[0][1]), len(rounds[1][1])
    assert second_steps < first_steps / 2, (first_steps, second_steps)


def test_a_request_follows_the_answer_one_in_flight_is_decoding_to_the_same_prompt(bundled) -> None:
    """Two clients send the same prompt, the second while the first is 24 tokens into its answer
    (nothing is in the corpus yet): the second drafts the first's answer as far as it has got,
    catches up and finishes within a step of it (fed by the counts of the finished answer alone it
    would be ~24 tokens behind, 3 or more steps), and both answer as the prompt alone."""
    from kvcache.generation import SuffixCorpus

    model, tokenizer = bundled
    counting = CountingModel(model)
    engine = Engine(counting, PrefixStore(chunk_size=16), eos=[], speculative=8, suffix_corpus=SuffixCorpus(),
                    draft_schedule="constant")  # fmt: skip
    prompt = prompt_ids(tokenizer, 3, 40)
    first, second = (Request(prompt=list(prompt), max_tokens=64, sampling=Sampling(False)) for _ in range(2))
    tokens, done_at, finished = {id(first): 0, id(second): 0}, {}, threading.Event()

    def sink(event, request):
        if event[0] == "token":
            tokens[id(request)] += 1
            if request is first and tokens[id(first)] == 24:
                engine.submit(second)
        elif event[0] in ("done", "error"):
            done_at[id(request)] = len(counting.fed)
            if len(done_at) == 2:
                finished.set()

    first.on_event = lambda event: sink(event, first)
    second.on_event = lambda event: sink(event, second)
    engine.start()
    try:
        engine.submit(first)
        assert finished.wait(120), "the engine did not answer"
    finally:
        engine.stop()
    expected = alone(model, prompt, 64)
    assert first.tokens == expected and second.tokens == expected
    assert done_at[id(second)] - done_at[id(first)] <= 1, done_at


def test_seeded_sampling_with_lookup_drafts_is_what_plain_decoding_samples(bundled) -> None:
    """Prompt-lookup and suffix drafts are point masses, verified by a sampling row's own draws in
    turn (`Verifier.verify`): seeded sampled answers, next to greedy rows, are those of the same
    engine without speculation, however much the adaptive gate drafted. Sent again with suffix
    drafting, the sampled answers repeat (same seeds), the corpus holds them, and the rows keep
    their drafts: far fewer steps, the same answers."""
    from kvcache.generation import SuffixCorpus

    model, tokenizer = bundled
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((30, 70, 45, 90))]

    def answers(rounds: int = 1, greedy_rows: bool = True, **kwargs) -> list[tuple[list[list[int]], int]]:
        counting = CountingModel(model)
        engine = Engine(counting, PrefixStore(chunk_size=16), eos=[], **kwargs)
        engine.start()
        try:
            out = []
            for _ in range(rounds):
                before = len(counting.fed)
                requests = [Request(prompt=p, max_tokens=30, seed=i,
                                    sampling=Sampling(not greedy_rows or i % 2 == 0, temperature=1.3))
                            for i, p in enumerate(prompts)]  # fmt: skip
                run_requests(engine, requests)
                steps = [s for s in counting.fed[before:] if s[1] <= 9]  # decode and verify forwards
                out.append(([r.tokens for r in requests], len(steps)))
            return out
        finally:
            engine.stop()

    plain = answers()[0][0]
    for _ in range(2):  # the gate's choices differ between runs; the samples may not
        assert answers(speculative=6)[0][0] == plain
    sampled = answers(greedy_rows=False)[0][0]
    suffix = {"speculative": 8, "suffix_corpus": SuffixCorpus(), "draft_schedule": "constant"}
    (first, first_steps), (second, second_steps) = answers(2, greedy_rows=False, **suffix)
    assert first == sampled and second == sampled
    assert second_steps < first_steps / 2, (first_steps, second_steps)


def test_under_the_gate_rows_draft_only_while_the_batch_is_small_enough(bundled, monkeypatch) -> None:
    """`draft_rows`: under the adaptive gate a step asks its rows for drafts only while the batch
    holds at most that many rows (a larger batch takes plain steps); the answers are unchanged."""
    from kvcache.generation import PromptLookupDrafter

    model, tokenizer = bundled
    batch_at_proposal: list[int] = []
    engine = Engine(model, PrefixStore(chunk_size=16), eos=[], speculative=4, draft_rows=1)

    class Watched(PromptLookupDrafter):
        def propose(self, sequence, num_tokens, pick):  # type: ignore[no-untyped-def]
            batch_at_proposal.append(len(engine._rows))
            return super().propose(sequence, num_tokens, pick)

    monkeypatch.setattr("kvcache.serve.speculation.PromptLookupDrafter", Watched)  # the server's drafter
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((30, 50, 20))]
    engine.start()
    try:
        requests = [Request(prompt=p, max_tokens=n, sampling=Sampling(False))
                    for p, n in zip(prompts, (6, 8, 40), strict=True)]  # fmt: skip
        run_requests(engine, requests)
    finally:
        engine.stop()
    for prompt, request, n in zip(prompts, requests, (6, 8, 40), strict=True):
        assert request.tokens == alone(model, prompt, n)
    assert batch_at_proposal and set(batch_at_proposal) == {1}  # the last request, once alone, drafted


def test_which_models_can_speculate() -> None:
    """`can_speculate`, what `kvcache serve` checks before drafting by default: attention and conv
    windows roll back token by token; Mamba states handed over token by token do (Falcon-H1's
    mixer asked for them, from transformers 5.25); a Mamba state kept only at a forward's end
    (Zamba2's) does not."""
    pytest.importorskip("transformers", minversion="5.24")
    from test_transformers_models import tiny_model, zamba2_model
    from test_transformers_rollback import KEEPS_RECURRENT_STATES

    from kvcache.integrations.transformers import wrap_model
    from kvcache.serve.speculation import can_speculate

    cpu = torch.device("cpu")
    assert can_speculate(load_default_model()[0], cpu)
    assert can_speculate(wrap_model(tiny_model("lfm2")), cpu)
    assert can_speculate(wrap_model(tiny_model("falcon_h1")), cpu) == KEEPS_RECURRENT_STATES
    assert not can_speculate(wrap_model(zamba2_model()), cpu)
    with pytest.raises(CacheInputError, match="rolled back"):
        Engine(wrap_model(zamba2_model()), PrefixStore(chunk_size=16), eos=[], speculative=2)


def test_a_model_that_cannot_mask_ragged_rows_speculates_while_one_row_runs() -> None:
    """Bloom builds its ALiBi biases from a 2-D padding mask, so a batch whose rows accepted
    different counts cannot be masked (every request in flight failed with a ValueError): with
    speculation asked for at every batch size, the engine drafts only while one row runs, and
    concurrent answers equal each prompt decoded alone."""
    pytest.importorskip("transformers", minversion="5.24")
    from test_transformers_rollback import _unmaskable

    from kvcache.integrations.transformers import wrap_model

    model = wrap_model(_unmaskable("bloom").double())
    prompts = [[(7 * i + j) % 50 + 3 for j in range(5)] * 3 for i in range(4)]  # repeats: lookup drafts
    engine = Engine(model, PrefixStore(chunk_size=16), eos=[], speculative=4, draft_schedule="constant")
    assert engine.draft_rows == 1
    requests, outcomes = serve_greedy(engine, prompts, 12)
    assert [o.events[-1][0] for o in outcomes] == ["done"] * 4
    assert [r.tokens for r in requests] == [alone(model, p, 12) for p in prompts]


def test_a_first_token_reaches_the_web_side_before_the_turns_decode_step(bundled) -> None:
    """A prefill's first token is handed to the request's event loop as soon as the prefill turn
    ends, not after the join and the decode step that follow it in the same turn (a step of a full
    batch, or a join that copies a long prompt, would delay every newcomer's first token)."""
    import asyncio

    from kvcache.serve.events import asyncio_sink

    model, tokenizer = bundled
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    first, done, seen_at_decode = threading.Event(), threading.Event(), []

    class Watching(CountingModel):
        def __call__(self, ids, **kwargs):
            if ids.shape[1] == 1 and kwargs.get("cache") is not None and kwargs["cache"].get_seq_length():
                seen_at_decode.append(first.wait(2.0))  # a decode step: has the first token arrived?
            return super().__call__(ids, **kwargs)

    async def consume(queue: asyncio.Queue) -> None:
        while True:
            kind, _ = await queue.get()
            first.set()
            if kind in ("done", "error"):
                done.set()
                return

    async def make_queue() -> asyncio.Queue:
        return asyncio.Queue()

    queue = asyncio.run_coroutine_threadsafe(make_queue(), loop).result(5)
    asyncio.run_coroutine_threadsafe(consume(queue), loop)
    engine = Engine(Watching(model), PrefixStore(chunk_size=16), eos=[])
    engine.start()
    try:
        request = Request(prompt=prompt_ids(tokenizer, 1, 40), max_tokens=3, sampling=Sampling(False))
        request.on_event = asyncio_sink(loop, queue)
        engine.submit(request)
        assert done.wait(30)
    finally:
        engine.stop()
        loop.call_soon_threadsafe(loop.stop)
    assert seen_at_decode and seen_at_decode[0], seen_at_decode


class KeepRecordingModel(CountingModel):
    """The model, recording the `logits_to_keep` each forward asked for (a parameter it names, so
    callers may pass it: `kvcache.protocol.takes_logits_to_keep`)."""

    def __call__(self, ids, logits_to_keep: int = 0, **kwargs):
        self.fed.append((tuple(ids.shape), logits_to_keep))
        return self.inner(ids, logits_to_keep=logits_to_keep, **kwargs)


def test_prefills_ask_for_the_last_positions_logits_only(bundled) -> None:
    """Prefill forwards (a group of cold prompts, a long prompt in blocks) compute the head on one
    position per row; decode steps are one position anyway. The answers are each prompt's alone."""
    model, tokenizer = bundled
    recording = KeepRecordingModel(model)
    engine = Engine(recording, PrefixStore(chunk_size=16), eos=[], max_step_tokens=64, speculative=0)
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((9, 14, 150))]
    requests, _ = serve_greedy(engine, prompts, 6)
    prefills = [(shape, keep) for shape, keep in recording.fed if shape[1] > 1]
    assert {keep for _, keep in prefills} == {1}
    assert any(shape[0] == 2 for shape, _ in prefills) and any(shape[1] == 48 for shape, _ in prefills)
    assert {keep for shape, keep in recording.fed if shape[1] == 1} == {0}
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.tokens == alone(model, prompt, 6)


def test_cold_newcomers_are_prefilled_together_and_store_what_they_computed(bundled) -> None:
    """Eight cold prompts of 9 to 60 tokens arriving together are prefilled in one forward (left
    padded to the longest): every answer equals its prompt decoded alone, and every chunk boundary
    inside each prompt is stored with the keys/values a forward of that prompt alone computes
    (float64: the batched forward differs in the last bits only), windows included, so the same
    prompts then hit the store and answer the same."""
    model, tokenizer = bundled
    counting = CountingModel(model)
    store = PrefixStore(chunk_size=16)
    engine = Engine(counting, store, eos=[], max_step_tokens=512)
    lengths = (9, 60, 17, 33, 40, 16, 50, 25)
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate(lengths)]
    first, again = twice(engine, prompts, 8)
    assert (len(lengths), max(lengths)) in counting.fed  # one forward for the burst
    for prompt, a, b in zip(prompts, first, again, strict=True):
        want = alone(model, prompt, 8)
        assert a.tokens == want and b.tokens == want
        assert a.cached_tokens == 0 and b.cached_tokens == (len(prompt) - 1) // 16 * 16
    for prompt in prompts:
        assert_stored_as_alone(store, model, counting, prompt, first=16)


def twice(engine: Engine, prompts: list[list[int]], n: int) -> tuple[list[Request], list[Request]]:
    """Greedy requests of `n` tokens for `prompts`, sent together, then the same again once the
    first ones are done (they find what the first ones stored)."""
    engine.start()
    try:
        first = [Request(prompt=p, max_tokens=n, sampling=Sampling(False)) for p in prompts]
        run_requests(engine, first)
        again = [Request(prompt=p, max_tokens=n, sampling=Sampling(False)) for p in prompts]
        run_requests(engine, again)
    finally:
        engine.stop()
    return first, again


def assert_stored_as_alone(store, model, counting, prompt: list[int], first: int) -> None:
    """Every 16-token boundary of `prompt` from `first` on is in `store`, holding what the prompt
    fed alone holds there (float64: the batched forwards sum alike to 1e-10)."""
    reference = model.new_cache()
    reference.activate_past_recording()  # keeps every token, windows included
    model(torch.tensor([prompt]), cache=reference, position_ids=torch.arange(len(prompt))[None])
    for boundary in range(first, len(prompt) + 1, 16):
        reused, cache = store.lookup([*prompt[:boundary], 0], counting)  # a token past it: the chunk is reused
        assert reused == boundary
        for got, want in zip(cache, reference, strict=True):
            held = got.state["keys"].shape[2]
            for name in ("keys", "values"):
                expected = want.state[name][:, :, boundary - held : boundary]
                torch.testing.assert_close(got.state[name], expected, rtol=0, atol=1e-10)


class GroupFailingModel(CountingModel):
    """The model, except that a forward of several prompts at once fails."""

    def __call__(self, ids, **kwargs):
        if ids.shape[0] > 1 and ids.shape[1] > 1 and kwargs["cache"].get_seq_length() == 0:
            raise RuntimeError("a batched prefill failed")
        return super().__call__(ids, **kwargs)


def test_a_failed_group_prefill_falls_back_to_one_prompt_at_a_time(bundled) -> None:
    """When the forward of newcomers prefilled together fails, each is prefilled alone: every
    request still gets its own answer, and none sees the group's error."""
    model, tokenizer = bundled
    failing = GroupFailingModel(model)
    engine = Engine(failing, PrefixStore(chunk_size=16), eos=[])
    prompts = [prompt_ids(tokenizer, i, 12 + 5 * i) for i in range(4)]
    requests, outcomes = serve_greedy(engine, prompts, 6)
    for prompt, request, outcome in zip(prompts, requests, outcomes, strict=True):
        assert outcome.events[-1] == ("done", "length")
        assert request.tokens == alone(model, prompt, 6)
    assert sum(1 for s in failing.fed if s[0] == 1 and s[1] > 1) == len(prompts)  # each alone


def tiny_hybrid():
    """A float64 `HybridLM`: linear attention, full attention, a parallel hybrid, a narrow window."""
    from kvcache.models import HybridConfig, HybridLM

    torch.manual_seed(0)
    layer_types = ["linear_attention", "full_attention", "hybrid", "sliding_attention"]
    return HybridLM(HybridConfig(vocab_size=512, layer_types=layer_types, sliding_window=8)).double().eval()


class LockstepModel(CountingModel):
    """The model, noting every forward of several prompts: such a forward must hold no padding
    (no attention mask) and every row at the same positions."""

    def __call__(self, ids, **kwargs):
        positions = kwargs.get("position_ids")
        if ids.shape[0] > 1 and ids.shape[1] > 1 and positions is not None and positions.shape[0] > 1:
            assert kwargs.get("attention_mask") is None and bool((positions == positions[:1]).all())
        return super().__call__(ids, **kwargs)


@pytest.mark.parametrize("kind", ["hybrid", "quantized"])
def test_newcomers_whose_rows_padding_would_change_are_never_padded(bundled, kind: str) -> None:
    """A recurrent state would run over a left pad, and a quantized layer's blocks would shift with
    it: for such models a burst of cold newcomers is never padded. A quantized model's prompts get
    a forward each; a hybrid's are fed together only where their blocks are alike (the same
    positions, the same length: here the first chunk of the two prompts longer than one), and
    every answer equals its prompt decoded alone."""
    model, tokenizer = bundled
    if kind == "hybrid":
        model = tiny_hybrid()
    else:
        model = load_default_model(dtype=torch.float64)[0]
        model.kv_bits = 4
    counting = LockstepModel(model)
    engine = Engine(counting, PrefixStore(chunk_size=16), eos=[])
    assert not engine.group_prefill and engine.lockstep == (kind == "hybrid")
    prompts = [[t % 500 for t in prompt_ids(tokenizer, i, 9 + 4 * i)] for i in range(4)]
    requests, _ = serve_greedy(engine, prompts, 5)
    together = [s for s in counting.fed if s[0] > 1 and s[1] > 1]
    assert together == ([(2, 16)] if kind == "hybrid" else [])  # prompts of 17 and 21 tokens: their first chunk
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.tokens == alone(model, prompt, 5)


def test_a_burst_of_newcomers_to_a_hybrid_is_fed_in_lockstep_and_stored_as_alone(bundled) -> None:
    """Eight cold prompts to a model with recurrent states (it cannot be padded) arriving together:
    their first chunks are fed in one forward, their rests of equal length together, no padding;
    every answer equals its prompt decoded alone; every state stored at a chunk boundary is what
    the prompt alone computes there (float64: the batched forward differs in the last bits), so
    the same prompts then hit the store and answer the same."""
    _, tokenizer = bundled
    model = tiny_hybrid()
    counting = LockstepModel(model)
    store = PrefixStore(chunk_size=16)
    engine = Engine(counting, store, eos=[], max_step_tokens=512)
    lengths = (20, 20, 37, 20, 37, 18, 18, 40)
    prompts = [[t % 500 for t in prompt_ids(tokenizer, i, n)] for i, n in enumerate(lengths)]
    first, again = twice(engine, prompts, 6)
    assert counting.fed[0] == (len(prompts), 16)  # every first chunk in one forward
    assert (3, 4) in counting.fed and (2, 2) in counting.fed  # the rests of 20 and of 18 tokens, together
    for prompt, a, b in zip(prompts, first, again, strict=True):
        want = alone(model, prompt, 6)
        assert a.tokens == want and b.tokens == want
        assert a.cached_tokens == 0 and b.cached_tokens == (len(prompt) - 1) // 16 * 16
        for boundary in range(16, len(prompt), 16):
            reference = model.new_cache()
            for start in range(0, boundary, 16):  # alone, a chunk a forward (as a lone prompt is fed)
                model(torch.tensor([prompt[start : start + 16]]), cache=reference,
                      position_ids=torch.arange(start, start + 16)[None])  # fmt: skip
            reused, cache = store.lookup([*prompt[:boundary], 0], counting)
            assert reused == boundary
            for got, want_layer in zip(cache, reference, strict=True):
                assert got.state.keys() == want_layer.state.keys()
                for name, tensor in got.state.items():
                    torch.testing.assert_close(tensor, want_layer.state[name], rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["bundled", "gemma3"])
def test_newcomers_that_continue_cached_prefixes_are_prefilled_together(bundled, kind: str, tmp_path) -> None:
    """Eight prompts that share a stored 64-token preamble and end in questions of 5 to 40 tokens
    arrive together: their rests go through one forward (the hits' caches stacked, the rests
    right-padded), every answer equals its prompt decoded alone, and the chunk boundaries inside
    the rests are stored with what a forward of the prompt alone computes (windows of 32 and, in a
    transformers Gemma3, of 6 tokens, where a chunk is kept as a snapshot of the window), so a
    third pass reuses them and answers the same."""
    model, tokenizer = bundled
    lengths = (5, 40, 17, 9, 33, 16, 12, 25)
    if kind == "gemma3":
        from serve_kit import tiny_model_dir

        from kvcache.models.text_model import from_directory

        model = from_directory(tiny_model_dir(tmp_path / "gemma3", "gemma3"), torch.float64).model
        lengths = (5, 16, 3, 9, 12, 16, 1, 11)  # a window of 6 takes blocks of one chunk
    counting = CountingModel(model)
    store = PrefixStore(chunk_size=16)
    engine = Engine(counting, store, eos=[], max_step_tokens=512, speculative=0)
    preamble = [t % 300 for t in prompt_ids(tokenizer, 99, 64)]
    prompts = [preamble + [t % 300 for t in prompt_ids(tokenizer, i, n)] for i, n in enumerate(lengths)]
    engine.start()
    try:
        run_requests(engine, [Request(prompt=[*preamble, 5], max_tokens=1, sampling=Sampling(False))])
        counting.fed.clear()
        hits = [Request(prompt=p, max_tokens=6, sampling=Sampling(False)) for p in prompts]
        run_requests(engine, hits)
        grouped = list(counting.fed)
        again = [Request(prompt=p, max_tokens=6, sampling=Sampling(False)) for p in prompts]
        run_requests(engine, again)
    finally:
        engine.stop()
    width = max(lengths)
    prefills = [shape for shape in grouped if shape[1] > 1]  # one forward for the rests, padded to the longest
    assert prefills in ([(8, width)], [(1, 16), (8, width)]), prefills  # (and the store's first check of its entries)
    for prompt, a, b in zip(prompts, hits, again, strict=True):
        want = alone(model, prompt, 6)
        assert a.tokens == want and b.tokens == want
        assert a.cached_tokens == 64 and b.cached_tokens == (len(prompt) - 1) // 16 * 16
    for prompt in prompts:
        assert_stored_as_alone(store, model, counting, prompt, first=80)


def test_rows_joining_a_full_attention_batch_get_their_own_answers() -> None:
    """A model whose layers are all full attention takes the join's block copy (`rows.join`):
    prompts of several lengths, prefilled over several turns (a small budget), join a running
    batch one after another, rows of shorter answers leave between joins; every greedy answer
    equals its prompt decoded alone."""
    from kvcache.models import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                           layer_types=["full_attention"] * 2)  # fmt: skip
    model = DecoderLM(config).to(torch.float64).eval()
    assert all(type(layer).__name__ == "DynamicLayer" for layer in model.new_cache())
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=rng).tolist() for n in (5, 40, 12, 70, 9, 33)]
    lengths = (3, 20, 7, 14, 25, 4)
    engine = Engine(model, PrefixStore(chunk_size=16), eos=[], max_step_tokens=24)
    engine.start()
    try:
        requests = [Request(prompt=p, max_tokens=n, sampling=Sampling(False))
                    for p, n in zip(prompts, lengths, strict=True)]
        outcomes = run_requests(engine, requests)
    finally:
        engine.stop()
    for prompt, n, request, outcome in zip(prompts, lengths, requests, outcomes, strict=True):
        assert outcome.events[-1] == ("done", "length")
        assert request.tokens == alone(model, prompt, n)


def test_the_engine_fingerprints_its_model_once(bundled, monkeypatch) -> None:
    """Hashing a model's identity (its config, every parameter's signature, a new cache) cost a
    millisecond per request; the served model does not change while it serves, so the engine
    computes it at its first request and every session chains its keys from that same root."""
    import kvcache.store.session as session_module

    model, tokenizer = bundled
    calls = []
    real = session_module.fingerprint
    monkeypatch.setattr(session_module, "fingerprint", lambda *a, **k: calls.append(1) or real(*a, **k))
    store = PrefixStore(chunk_size=16)
    prompts = [prompt_ids(tokenizer, i, 40) for i in range(4)]
    requests, _ = serve_greedy(Engine(model, store, eos=[]), prompts, 3)
    assert len(calls) == 1
    assert all(r.session.root == store.identity(model).root for r in requests)
    assert store.lookup(prompts[0], model)[0] == 32  # what the engine stored is found by a fresh session


def test_logprobs_of_accepted_drafts_come_from_their_verify_positions(bundled) -> None:
    """A request that asks for log probabilities under speculation: every token's (drafted and
    accepted, or the verify forward's own choice) is the model's at that position, within float64
    rounding of one forward over prompt and answer (another forward shape: not bit for bit), with
    the top 2; rows that do not ask get bare tokens. Drafts were fed and accepted (forwards wider
    than one token, fewer steps than tokens)."""
    from kvcache.serve.logprobs import TokenLogprobs

    model, tokenizer = bundled
    prompts = [prompt_ids(tokenizer, i, 60) for i in range(4)]
    counting = CountingModel(model)
    engine = Engine(counting, PrefixStore(chunk_size=16), eos=[], speculative=4, draft_schedule="constant")
    engine.start()
    try:
        requests = [Request(prompt=p, max_tokens=24, sampling=Sampling(False), logprobs=2 if i else None)
                    for i, p in enumerate(prompts)]  # fmt: skip
        outcomes = run_requests(engine, requests)
    finally:
        engine.stop()
    assert any(shape[1] > 1 for shape in counting.fed[1:]) and len(counting.fed) < 24 + len(prompts)
    for request, outcome in zip(requests, outcomes, strict=True):
        given = [event[1] for event in outcome.events if event[0] == "token"]
        if request.logprobs is None:
            assert given == request.tokens
            continue
        assert [t.token for t in given] == request.tokens == alone(model, request.prompt, 24)
        ids = torch.tensor([request.prompt + request.tokens])
        with torch.no_grad():
            logits = model(ids, cache=model.new_cache(), position_ids=torch.arange(ids.shape[1])[None])
        expected = logits[0, len(request.prompt) - 1 : -1].log_softmax(-1)
        for position, entry in enumerate(given):
            assert isinstance(entry, TokenLogprobs) and len(entry.top) == 2
            assert abs(entry.logprob - float(expected[position, entry.token])) < 1e-9
            values, best = expected[position].topk(2)
            assert [i for i, _ in entry.top] == best.tolist()
            assert all(abs(v - float(w)) < 1e-9 for (_, v), w in zip(entry.top, values, strict=True))


def seeded_answers(model, prompts: list[list[int]], n: int, sampling: Sampling, **engine_args) -> list[list[int]]:
    """Each prompt's `n` tokens from one engine (`engine_args`), all requests together, prompt i seeded i."""
    engine = Engine(model, PrefixStore(chunk_size=16), eos=[], **engine_args)
    requests = [Request(prompt=p, max_tokens=n, seed=i, sampling=sampling) for i, p in enumerate(prompts)]
    engine.start()
    try:
        run_requests(engine, requests)
    finally:
        engine.stop()
    return [r.tokens for r in requests]


def biased_greedy(model, prompt: list[int], n: int, bias: tuple[tuple[int, float], ...]) -> list[int]:
    """Greedy decoding with `bias` added to the logits, step by step (the reference for `logit_bias`)."""
    cache, out = model.new_cache(), []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, position_ids=torch.arange(len(prompt))[None])
        for i in range(n):
            scores = logits[0, -1].float().clone()
            for token, value in bias:
                scores[token] += value
            out.append(int(scores.argmax()))
            logits = model(torch.tensor([out[-1:]]), cache=cache, position_ids=torch.tensor([[len(prompt) + i]]))
    return out


def test_logit_bias_is_honoured_by_plain_and_speculative_steps(bundled) -> None:
    """OpenAI's `logit_bias` (`Sampling.logit_bias`): greedy rows, in plain steps and verified drafts
    alike, give what greedy decoding of the biased logits gives (banning tokens the unbiased answers
    use changes them), and seeded sampled rows with a bias sample under speculation what they
    sample without."""
    model, tokenizer = bundled
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((40, 70))]  # repetitive: lookup drafts
    unbiased = [alone(model, p, 20) for p in prompts]
    bias = ((unbiased[0][3], -100.0), (unbiased[1][5], -100.0))
    expected = [biased_greedy(model, p, 20, bias) for p in prompts]
    assert expected != unbiased and all(t not in answer for answer in expected for t, _ in bias)

    def run(sample: bool, **kwargs) -> list[list[int]]:
        return seeded_answers(model, prompts, 20, Sampling(sample, 1.3, logit_bias=bias), **kwargs)

    assert run(False) == expected
    assert run(False, speculative=6, draft_schedule="constant") == expected
    sampled = run(True)
    assert all(t not in answer for answer in sampled for t, _ in bias)
    assert run(True, speculative=6, draft_schedule="constant") == sampled


def penalized_greedy(model, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding of the logits less OpenAI's penalties for the tokens generated so far, step by
    step (the reference for `presence_penalty` and `frequency_penalty`)."""
    cache, out = model.new_cache(), []
    counts = torch.zeros(int(model.vocab_size), dtype=torch.float64)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, position_ids=torch.arange(len(prompt))[None])
        for i in range(n):
            scores = logits[0, -1].double() - frequency * counts - presence * (counts > 0).double()
            out.append(int(scores.argmax()))
            counts[out[-1]] += 1
            logits = model(torch.tensor([out[-1:]]), cache=cache, position_ids=torch.tensor([[len(prompt) + i]]))
    return out


def test_penalties_are_honoured_by_plain_and_speculative_steps(bundled) -> None:
    """Presence and frequency penalties: greedy rows, in plain steps and in verified drafts alike (a
    draft's own earlier tokens count at each position it is checked at), give what greedy decoding
    of the penalized logits gives, which differs from the plain answers; seeded sampled rows with
    penalties sample under speculation what they sample without (and not what they sample
    without penalties)."""
    model, tokenizer = bundled
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((40, 70))]  # repetitive: lookup drafts
    plain = [alone(model, p, 24) for p in prompts]
    expected = [penalized_greedy(model, p, 24, 0.4, 0.7) for p in prompts]
    assert expected != plain

    def run(sample: bool, penalties: tuple[float, float] = (0.4, 0.7), **kwargs) -> list[list[int]]:
        sampling = Sampling(sample, 1.3, presence_penalty=penalties[0], frequency_penalty=penalties[1])
        return seeded_answers(model, prompts, 24, sampling, **kwargs)

    assert run(False) == expected
    assert run(False, speculative=6, draft_schedule="constant") == expected
    sampled = run(True)
    assert sampled == run(True, speculative=6, draft_schedule="constant")
    assert sampled != run(True, penalties=(0.0, 0.0))


def repetition_greedy(model, prompt: list[int], n: int, penalty: float) -> list[int]:
    """Greedy decoding with transformers' repetition penalty over the prompt and the tokens generated
    so far, step by step (the reference for `repetition_penalty`)."""
    cache, out, seen = model.new_cache(), [], set(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, position_ids=torch.arange(len(prompt))[None])
        for i in range(n):
            scores = logits[0, -1].float().clone()
            for token in seen:
                scores[token] = scores[token] / penalty if scores[token] > 0 else scores[token] * penalty
            out.append(int(scores.argmax()))
            seen.add(out[-1])
            logits = model(torch.tensor([out[-1:]]), cache=cache, position_ids=torch.tensor([[len(prompt) + i]]))
    return out


def test_repetition_penalty_is_honoured_by_plain_and_speculative_steps(bundled) -> None:
    """transformers' repetition penalty (the prompt's tokens and the answer's so far): greedy rows in
    plain steps and in verified drafts give what greedy decoding of the penalized logits gives,
    which differs from the plain answers; seeded sampled rows sample under speculation what they
    sample without (and not what they sample without the penalty)."""
    model, tokenizer = bundled
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((40, 70))]  # repetitive: lookup drafts
    plain = [alone(model, p, 24) for p in prompts]
    expected = [repetition_greedy(model, p, 24, 1.4) for p in prompts]
    assert expected != plain

    def run(sample: bool, penalty: float = 1.4, **kwargs) -> list[list[int]]:
        return seeded_answers(model, prompts, 24, Sampling(sample, 1.3, repetition_penalty=penalty), **kwargs)

    assert run(False) == expected
    assert run(False, speculative=6, draft_schedule="constant") == expected
    sampled = run(True)
    assert sampled == run(True, speculative=6, draft_schedule="constant")
    assert sampled != run(True, penalty=1.0)


@pytest.mark.parametrize("seed", range(6))
def test_rows_decided_together_get_the_tokens_each_gets_alone(seed: int) -> None:
    """`step_tokens` over a batch of rows with mixed settings (greedy, a logit bias, penalties, a
    temperature with top-k / top-p / min-p, each shared by several rows or alone) gives every row
    the token that scoring it alone and drawing from its own generator gives."""
    from kvcache.serve.row_tokens import step_tokens

    rng = torch.Generator().manual_seed(seed)
    vocab = 50
    settings = [Sampling(False), Sampling(False, logit_bias=((3, 5.0),)), Sampling(False, repetition_penalty=1.3),
                Sampling(False, presence_penalty=0.5, frequency_penalty=0.3),
                Sampling(True, 0.8, top_k=10, top_p=0.9), Sampling(True, 1.2, min_p=0.05, repetition_penalty=1.2),
                Sampling(True, 0.7)]  # fmt: skip
    rows = []
    for b in range(12):
        sampling = settings[int(torch.randint(len(settings), (1,), generator=rng))]
        row = Request(prompt=torch.randint(vocab, (8,), generator=rng).tolist(), max_tokens=4, sampling=sampling,
                      seed=b)  # fmt: skip
        row.generator = torch.Generator().manual_seed(100 + b)
        if sampling.penalized:
            row.counts = torch.randint(0, 3, (vocab,), generator=rng).float()
        if sampling.repetition_penalty != 1:
            row.prompt_seen = torch.zeros(vocab, dtype=torch.bool)
            row.prompt_seen[row.prompt] = True
        rows.append(row)
    logits = torch.randn(len(rows), vocab, generator=rng) * 3
    states = [r.generator.get_state() for r in rows]
    together = step_tokens(rows, logits)
    for b, row in enumerate(rows):
        scores = row.sampling.scores(logits[b : b + 1], row.counts, row.prompt_seen)
        if row.sampling.do_sample:
            alone = int(torch.multinomial(scores.softmax(-1), 1, generator=torch.Generator().set_state(states[b])))
        else:
            alone = int(scores.argmax(-1))
        assert together[b] == alone, (b, row.sampling)


class GroupShySampling(Sampling):
    def scores(self, logits, counts=None, seen=None):  # fails for several rows at once, works for one
        if logits.shape[0] > 1:
            raise RuntimeError("scored together")
        return super().scores(logits, counts, seen)


def test_greedy_rows_scored_together_fall_back_to_each_row_alone(bundled) -> None:
    """Penalized greedy rows of one sampling are scored in one call; where that call fails, each row
    is scored alone and still gets its own greedy tokens (no row fails for the group)."""
    model, tokenizer = bundled
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((40, 70, 55))]
    for sampling in (Sampling(False, repetition_penalty=1.4), GroupShySampling(False, repetition_penalty=1.4)):
        answers = seeded_answers(model, prompts, 16, sampling)
        assert answers == [repetition_greedy(model, p, 16, 1.4) for p in prompts], type(sampling).__name__


def test_repetition_penalty_scores_as_transformers_processor() -> None:
    """`Sampling.scores` with `repetition_penalty`: transformers' `RepetitionPenaltyLogitsProcessor`
    over the prompt's tokens (`seen`) and the generated ones (`counts`), bit for bit, before the
    temperature; greedy rows with it are no longer argmax-only; a penalty <= 0 or not finite is
    refused."""
    from kvcache.errors import GenerationError

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 3
    prompt, generated = [3, 7, 7, 21], [5, 7, 30]
    seen = torch.zeros(40, dtype=torch.bool)
    seen[prompt] = True
    counts = torch.zeros(40)
    for token in generated:
        counts[token] += 1
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.7)
    expected = processor(torch.tensor([prompt + generated]), logits.clone())
    assert torch.equal(Sampling(repetition_penalty=1.7).scores(logits, counts, seen), expected)
    assert torch.equal(Sampling(True, 0.5, repetition_penalty=1.7).scores(logits, counts, seen), expected / 0.5)
    prompt_only = processor(torch.tensor([prompt]), logits.clone())
    assert torch.equal(Sampling(repetition_penalty=1.7).scores(logits, None, seen), prompt_only)
    assert not Sampling(repetition_penalty=1.1).argmax_only and Sampling(repetition_penalty=1).argmax_only
    for bad in (0, -1.2, float("inf"), float("nan"), True, "1"):
        with pytest.raises(GenerationError, match="repetition_penalty must be a finite number > 0"):
            Sampling(repetition_penalty=bad)


def test_penalties_are_scores_less_the_counts() -> None:
    """`Sampling.scores` with counts: the logits less `frequency_penalty` per count and
    `presence_penalty` where a count is positive, before the temperature; without counts or
    penalties, the logits alone; a penalty that is not a finite number is refused."""
    from kvcache.errors import GenerationError

    logits = torch.randn(3, 11, dtype=torch.float64)
    counts = torch.tensor([0, 2, 0, 1, 0, 0, 0, 0, 0, 5, 0], dtype=torch.float32)
    sampling = Sampling(True, 0.5, presence_penalty=0.25, frequency_penalty=-0.5)
    expected = (logits.float() + 0.5 * counts - 0.25 * (counts > 0).float()) / 0.5
    assert torch.equal(sampling.scores(logits, counts), expected)
    assert torch.equal(sampling.scores(logits), logits.float() / 0.5)
    assert torch.equal(Sampling().scores(logits, counts), logits.float())
    assert Sampling().argmax_only and not Sampling(frequency_penalty=0.1).argmax_only
    for bad in (float("nan"), float("inf"), "1", True, None):
        with pytest.raises(GenerationError, match="presence_penalty must be a finite number"):
            Sampling(presence_penalty=bad)
