"""vLLM's request fields for where an answer ends, in the engine and through the official `openai`
client: `stop_token_ids` (more tokens that end it), `ignore_eos` (the model's end tokens do not),
`min_tokens` (no end token, stop id or stop string before that many tokens),
`include_stop_str_in_output`, and the `stop_reason` each choice reports.

The reference is greedy decoding step by step with the end tokens' logits banned by hand while
the answer is short, stopping at the first end token (kept, as the engine keeps it). The bundled
model runs in float64, where batched and single-row kernels agree far below any logit gap.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from test_serve_engine import alone, prompt_ids, run_requests

from kvcache.generation.sampling import Sampling
from kvcache.models import load_default_model
from kvcache.serve.engine import Engine, Request
from kvcache.store import PrefixStore

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "kvcache-default"


@pytest.fixture(scope="module")
def bundled():
    return load_default_model(dtype=torch.float64)


def ended_greedy(model, prompt: list[int], n: int, ends: set[int], min_tokens: int = 0) -> list[int]:
    """Greedy decoding of at most `n` tokens that stops at the first of `ends` (kept), whose logits
    are -inf while fewer than `min_tokens` tokens were generated."""
    cache, out = model.new_cache(), []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, position_ids=torch.arange(len(prompt))[None])
        while len(out) < n:
            scores = logits[0, -1].clone()
            if len(out) < min_tokens:
                scores[sorted(ends)] = float("-inf")
            out.append(int(scores.argmax()))
            if out[-1] in ends:
                break
            at = torch.tensor([[len(prompt) + len(out) - 1]])
            logits = model(torch.tensor([out[-1:]]), cache=cache, position_ids=at)
    return out


GREEDY = Sampling(False)


def answers(model, prompts: list[list[int]], n: int, eos: list[int], sampling: Sampling = GREEDY,
            **fields) -> list[Request]:  # fmt: skip
    """Each prompt's request (`fields` set on every one, prompt i seeded i), answered by one engine
    with end tokens `eos`, plain and, when `speculative` is in `fields`, with prompt-lookup drafts."""
    engine_args = {k: fields.pop(k) for k in ("speculative", "draft_schedule") if k in fields}
    engine = Engine(model, PrefixStore(chunk_size=16), eos=eos, **engine_args)
    requests = [Request(prompt=p, max_tokens=n, seed=i, sampling=sampling, **fields) for i, p in enumerate(prompts)]
    engine.start()
    try:
        run_requests(engine, requests)
    finally:
        engine.stop()
    return requests


@pytest.mark.parametrize("speculative", [0, 6])
def test_end_tokens_min_tokens_and_ignore_eos_in_plain_and_verified_steps(bundled, speculative: int) -> None:
    """An end token chosen greedily ends the answer (kept as its last token); `ignore_eos` decodes
    past it to `max_tokens` as if there were none; `min_tokens` bans it until the answer is that
    long, which changes the answer to what the banned logits give; stop ids end an answer as end
    tokens do, `ignore_eos` or not. Plain steps and verified prompt-lookup drafts alike."""
    model, tokenizer = bundled
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((40, 70))]  # repetitive: lookup drafts
    plain = [alone(model, p, 30) for p in prompts]
    end = plain[0][2]  # the first answer ends at its third token; the second wherever it meets it
    spec = {"speculative": speculative, "draft_schedule": "constant"} if speculative else {}
    ended = [ended_greedy(model, p, 30, {end}) for p in prompts]
    assert len(ended[0]) == 3 and ended[0][-1] == end
    got = answers(model, prompts, 30, [end], **spec)
    assert [r.tokens for r in got] == ended
    assert [r.finish_reason for r in got] == ["stop" if a[-1] == end else "length" for a in ended]
    assert [r.tokens for r in answers(model, prompts, 30, [end], ignore_eos=True, **spec)] == plain
    late = [ended_greedy(model, p, 30, {end}, min_tokens=8) for p in prompts]  # ending soon after the 8th
    assert late != ended and all(end not in a[:8] and len(a) > 8 and a[-1] == end for a in late)
    assert [r.tokens for r in answers(model, prompts, 30, [end], min_tokens=8, **spec)] == late
    stop_ids = frozenset({end})  # a stop id: the same, whatever ignore_eos says and with no end tokens
    assert [r.tokens for r in answers(model, prompts, 30, [], stop_ids=stop_ids, **spec)] == ended
    assert [r.tokens for r in answers(model, prompts, 30, [], stop_ids=stop_ids, ignore_eos=True, **spec)] == ended
    assert [r.tokens for r in answers(model, prompts, 30, [], stop_ids=stop_ids, min_tokens=8, **spec)] == late


def test_seeded_sampling_under_min_tokens_is_what_plain_steps_sample(bundled) -> None:
    """Sampled rows short of `min_tokens` never draw an end token, and verified drafts draw what
    plain steps draw, seed for seed."""
    model, tokenizer = bundled
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate((40, 70))]
    ends = sorted({t for p in prompts for t in alone(model, p, 10)})[:6]  # tokens these answers use
    sampling = Sampling(True, 1.2)
    plain = answers(model, prompts, 24, ends, sampling, min_tokens=20)
    assert all(len(r.tokens) >= 20 and not set(r.tokens[:20]) & set(ends) for r in plain)
    drafted = answers(model, prompts, 24, ends, sampling, min_tokens=20, speculative=6, draft_schedule="constant")
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]


def test_the_ban_covers_exactly_the_positions_short_of_min_tokens() -> None:
    """`ban_early_ends` on a verify forward's logits `[rows, width, vocab]` against a loop over
    every row, position and token: -inf exactly where the token would end a row that is short."""
    from kvcache.serve.row_tokens import ban_early_ends

    eos = frozenset({3, 7})
    rows = [Request(prompt=[0], max_tokens=9, sampling=Sampling(False), min_tokens=m, ignore_eos=ignore,
                    stop_ids=frozenset(stops)) for m, ignore, stops in
            ((5, False, ()), (5, True, (2,)), (2, False, (2,)), (0, False, (2,)), (4, True, ()))]  # fmt: skip
    for row, made in zip(rows, (1, 3, 2, 0, 0), strict=True):
        row.tokens = [9] * made
    logits = torch.randn(len(rows), 6, 12)
    expected = logits.clone()
    for b, row in enumerate(rows):
        ends = set(row.stop_ids) | (set() if row.ignore_eos else eos)
        for j in range(6):
            for token in ends:
                if len(row.tokens) + j < row.min_tokens:
                    expected[b, j, token] = float("-inf")
    ban_early_ends(rows, logits, eos)
    assert torch.equal(logits, expected) and int(torch.isinf(expected).sum()) == 4 * 2 + 2 * 1
    single = torch.randn(len(rows), 12)
    want = single.clone()
    want[0, [3, 7]] = float("-inf")
    want[1, 2] = float("-inf")
    ban_early_ends(rows, single, eos)
    assert torch.equal(single, want)


# ---------------------------------------------------------------------------------- through HTTP
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_kit import module_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory)


def test_stop_token_ids_min_tokens_and_the_stop_reason_through_the_client(server, bundled) -> None:
    """The bundled model is character-level (one character a token): `stop_token_ids` ends the text
    at that character (kept, as vLLM keeps a stop token that is not special), `min_tokens` bans it
    until the answer is that long, and `stop_reason` names the id; streamed alike."""
    model, tokenizer = bundled
    prompt = "The value of the "
    ids = tokenizer.encode(prompt)
    full = alone(model, ids, 40)
    stop = full[6]
    c = server.client()
    for min_tokens in (0, 15):
        want = ended_greedy(model, ids, 40, {stop}, min_tokens)
        extra = {"stop_token_ids": [stop], "min_tokens": min_tokens}
        whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body=extra)
        assert whole.choices[0].text == tokenizer.decode(want) and whole.usage.completion_tokens == len(want)
        assert whole.choices[0].finish_reason == "stop" and whole.choices[0].model_extra["stop_reason"] == stop
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                           extra_body=extra))  # fmt: skip
        assert "".join(ch.choices[0].text for ch in chunks) == tokenizer.decode(want)
        assert chunks[-1].choices[0].model_extra["stop_reason"] == stop
    assert len(ended_greedy(model, ids, 40, {stop}, 15)) > 15 > 7
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].model_extra["stop_reason"] is None


def test_stop_strings_wait_for_min_tokens_and_can_stay_in_the_text(server, bundled) -> None:
    """A stop string that ends within the first `min_tokens` tokens' text is passed over (the
    answer stops at its next occurrence); `include_stop_str_in_output` keeps the stop string it
    ended on; `stop_reason` names it. Chat and completions, whole and streamed."""
    model, tokenizer = bundled
    prompt = "The value of the "
    full = tokenizer.decode(alone(model, tokenizer.encode(prompt), 60))
    stop = next(full[i : i + 2] for i in range(40) if full[i : i + 2] in full[i + 4 : 58])  # occurs twice
    first = full.index(stop)
    second = full.index(stop, first + 1)
    c = server.client()
    cases = [({}, full[:first]), ({"include_stop_str_in_output": True}, full[: first + 2]),
             ({"min_tokens": first + 2}, full[:second]), ({"min_tokens": first + 1}, full[:first])]  # fmt: skip
    for extra, want in cases:
        answer = c.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=stop,
                                      extra_body=extra)  # fmt: skip
        assert answer.choices[0].text == want, extra
        assert answer.choices[0].model_extra["stop_reason"] == stop
        streamed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=stop,
                                        stream=True, extra_body=extra)  # fmt: skip
        assert "".join(ch.choices[0].text for ch in streamed) == want, extra
    messages = [{"role": "user", "content": "What does a cache hold?"}]
    chat_full = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    text = chat_full.choices[0].message.content
    chat_stop = text[5:7]
    kept = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=chat_stop,
                                     extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert kept.choices[0].message.content == text[: text.index(chat_stop) + 2]
    assert kept.choices[0].model_extra["stop_reason"] == chat_stop


BAD = [
    ({"min_tokens": 11, "max_tokens": 10}, "min_tokens must be at most max_tokens (10)"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos must be a boolean"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a boolean"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids must be a list"),
    ({"stop_token_ids": [True]}, "stop_token_ids must be a list"),
    ({"stop_token_ids": list(range(65))}, "at most 64"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids must be in [0, 103)"),
]


@pytest.mark.parametrize(("fields", "words"), BAD)
def test_bad_end_fields_are_400s_naming_the_field(server, fields: dict, words: str) -> None:
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": "x"}]})):
        answer = httpx.post(server.url + path, json={"max_tokens": 20, **body, **fields}, timeout=30)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert words in error["message"] and error["param"] == next(iter(k for k in fields if k != "max_tokens"))
