"""The device matrix: the core promises on every device present (`device` fixture: the CPU always,
CUDA and MPS where available), so the same command checks a GPU machine.

Rollback of every layer kind, persistence from a device cache to a file and back onto any device,
deferred == immediate stop checks, speculative == greedy (one row and a ragged batch with per-row
rollback), prefix-store hits rebuilt on the model's device, and the server's engine. Models are
float64 with sharpened weights where greedy tokens are compared across different computations, so
no answer hinges on a near-tie; the same computation on one device is compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_speculative import make_target

from kvcache import StaticCache, load_cache, save_cache
from kvcache.generation import PromptLookupDrafter, generate, speculative_generate
from kvcache.generation.sampling import Sampling
from kvcache.models import HybridConfig, HybridLM
from kvcache.serve.engine import Engine, Request
from kvcache.store import PrefixStore

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 40
#: Every layer kind the reference models write: full, sliding, linear-attention (conv + matrix
#: state) and parallel hybrid layers.
LAYER_TYPES = ["full_attention", "sliding_attention", "linear_attention", "hybrid"]


def hybrid(device: torch.device, **extra: object) -> HybridLM:
    torch.manual_seed(0)
    config = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                          layer_types=LAYER_TYPES, sliding_window=4, recurrent_heads=2, recurrent_key_dim=8,
                          recurrent_value_dim=8, **extra)  # fmt: skip
    return HybridLM(config).double().eval().to(device)


def ids(device: torch.device, length: int, seed: int = 1, batch: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def states(cache) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in layer.state.items()} for layer in cache]


def assert_same_states(got, want, device: torch.device) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), i
        for name in a:
            assert a[name].device.type == device.type, (i, name, a[name].device)
            assert torch.equal(a[name], b[name]), (i, name)


@pytest.mark.parametrize("kind", ["dynamic", "quantized", "static"])
def test_rollback_of_every_layer_kind_is_exact(device: torch.device, kind: str) -> None:
    """Feed 5 tokens while recording, crop(-3): the states equal those of a cache fed only the
    first 2 (bit for bit; a static ring keeps cropped slots as they are, unread, so there the
    tokens it holds are compared), and the next forward's logits equal that cache's."""
    model = hybrid(device)
    prompt, extra = ids(device, 11), ids(device, 5, seed=2)

    def fresh():
        if kind == "static":
            return StaticCache(64, layer_types=LAYER_TYPES, sliding_window=4)
        if kind == "quantized":
            model.kv_bits = 4
        cache = model.new_cache()
        model.kv_bits = None
        return cache

    with torch.no_grad():
        cropped, plain = fresh(), fresh()
        for cache in (cropped, plain):
            model(prompt, cache=cache, position_ids=torch.arange(11, device=device)[None])
        cropped.activate_past_recording()
        for t in range(5):  # decode steps, as the driver feeds them
            model(extra[:, t : t + 1], cache=cropped, position_ids=torch.tensor([[11 + t]], device=device))
        cropped.crop(-3)
        cropped.stop_past_recording()
        for t in range(2):
            model(extra[:, t : t + 1], cache=plain, position_ids=torch.tensor([[11 + t]], device=device))
        assert cropped.get_seq_length() == plain.get_seq_length() == 13
        if kind != "static":
            assert_same_states(states(cropped), states(plain), device)
        nxt, pos = extra[:, 2:3], torch.tensor([[13]], device=device)
        assert torch.equal(model(nxt, cache=cropped, position_ids=pos), model(nxt, cache=plain, position_ids=pos))


def test_persistence_round_trips_between_devices(device: torch.device, tmp_path: Path) -> None:
    """A cache built on the device, saved, loaded onto the device and onto the CPU (and a CPU
    file loaded onto the device): the same tensors, on the device asked for, and the loaded cache
    continues exactly as the original."""
    model = hybrid(device)
    with torch.no_grad():
        cache = model.new_cache()
        model(ids(device, 13), cache=cache, position_ids=torch.arange(13, device=device)[None])
    save_cache(cache, tmp_path / "c.kvcache")
    on_device = load_cache(tmp_path / "c.kvcache", device=device)
    on_cpu = load_cache(tmp_path / "c.kvcache", device="cpu")
    assert_same_states(states(on_device), states(cache), device)
    cpu = torch.device("cpu")
    assert_same_states(states(on_cpu), [{k: v.cpu() for k, v in s.items()} for s in states(cache)], cpu)
    save_cache(on_cpu, tmp_path / "cpu.kvcache")
    assert_same_states(states(load_cache(tmp_path / "cpu.kvcache", device=device)), states(cache), device)
    nxt, pos = ids(device, 1, seed=5), torch.tensor([[13]], device=device)
    with torch.no_grad():
        assert torch.equal(model(nxt, cache=on_device, position_ids=pos), model(nxt, cache=cache, position_ids=pos))


@pytest.mark.parametrize("do_sample", [False, True])
def test_deferred_stop_equals_immediate_stop(device: torch.device, do_sample: bool) -> None:
    """Same tokens and the same cache either way, including the step taken past the eos and
    undone (an eos the run reaches: the 4th token the model picks, greedy)."""
    model = hybrid(device)
    prompt = ids(device, 9)
    free = generate(model, prompt, max_new_tokens=8, eos_token_id=[])
    new = free.sequences[0, 9:].tolist()
    eos = new[3]
    outs = []
    for defer in (False, True):
        generator = torch.Generator(device=device).manual_seed(3) if do_sample else None
        outs.append(generate(model, prompt, max_new_tokens=8, eos_token_id=eos, defer_stop=defer,
                             do_sample=do_sample, generator=generator))  # fmt: skip
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].sequences.device.type == device.type
    assert_same_states(states(outs[1].cache), states(outs[0].cache), device)
    if not do_sample:
        assert outs[0].sequences.shape[1] == 9 + new.index(eos) + 1  # stopped at the eos


@pytest.mark.parametrize("kind", ["full", "sliding", "hybrid"])
def test_speculative_equals_greedy(device: torch.device, kind: str) -> None:
    target = make_target(kind).to(device)
    prompt = torch.tensor([[3, 5, 7, 3, 5, 7, 3, 5, 9, 3, 5, 7, 3]], device=device)
    want = generate(target, prompt, max_new_tokens=20, eos_token_id=[])
    got = speculative_generate(target, PromptLookupDrafter(), prompt, max_new_tokens=20, eos_token_id=[],
                               draft_schedule="constant")  # fmt: skip
    assert torch.equal(got.sequences, want.sequences)
    assert sum(got.accepted_per_step) > 0  # drafts were taken, so rollback ran


def test_batched_speculation_rolls_rows_back_one_by_one(device: torch.device) -> None:
    """A left-padded batch: each row accepts its own count and is cropped by it, and the batch
    gives what batched greedy `generate` gives."""
    target = make_target("hybrid").to(device)
    prompt = torch.tensor([[0, 0, 3, 5, 7, 3, 5, 7, 3], [2, 9, 4, 2, 9, 4, 2, 9, 1]], device=device)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9], device=device)
    want = generate(target, prompt, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    got = speculative_generate(target, PromptLookupDrafter(), prompt, attention_mask=mask, max_new_tokens=16,
                               eos_token_id=[])  # fmt: skip
    assert torch.equal(got.sequences, want.sequences)


def test_store_hits_are_rebuilt_on_the_model_device(device: torch.device) -> None:
    """The second run of a prompt hits every whole chunk; its cache lives on the model's device and
    the output is the first run's (the store feeds whole chunks either way)."""
    model = hybrid(device)
    store = PrefixStore(chunk_size=8)
    prompt = ids(device, 37)
    first = generate(model, prompt, max_new_tokens=6, prefix_store=store)
    reused, cache = store.lookup(prompt[0].tolist(), model)
    assert reused == 32
    assert all(t.device.type == device.type for layer in cache for t in layer.state.values())
    second = generate(model, prompt, max_new_tokens=6, prefix_store=store)
    assert store.stats.hits >= 1
    assert torch.equal(first.sequences, second.sequences)
    assert_same_states(states(second.cache), states(first.cache), device)


def test_the_server_engine_answers_on_the_device(device: torch.device) -> None:
    """Five concurrent greedy requests through the engine equal each prompt decoded alone."""
    import threading

    model = make_target("full").to(device)
    prompts = [ids(device, n, seed=n, vocab=model.vocab_size)[0].tolist() for n in (5, 17, 30, 9, 12)]
    engine = Engine(model, PrefixStore(chunk_size=8), eos=[], max_step_tokens=64)
    done = [threading.Event() for _ in prompts]
    requests = [Request(prompt=p, max_tokens=10, sampling=Sampling(False),
                        on_event=lambda e, d=d: d.set() if e[0] in ("done", "error") else None)
                for p, d in zip(prompts, done, strict=True)]  # fmt: skip
    engine.start()
    try:
        for request in requests:
            engine.submit(request)
        assert all(d.wait(120) for d in done)
    finally:
        engine.stop()
    for p, request in zip(prompts, requests, strict=True):
        alone = generate(model, torch.tensor([p], device=device), max_new_tokens=10, eos_token_id=[])
        assert request.finish_reason == "length"
        assert request.tokens == alone.sequences[0, len(p) :].tolist()
