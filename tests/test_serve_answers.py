"""`kvcache serve` answers beyond one text, through the official `openai` client: several choices
(`n`, a completion's list of prompts), each what the same request alone gives, and log
probabilities (`logprobs`) against an independent reference: the bundled model (float64, as
the server runs it) reading the prompt and the answer in one forward, `log_softmax` at each
answer position. The server computed each token's in another forward (a prefill, a batch's
decode step), so the two agree within float64 rounding (1e-9 here), not bit for bit. Under
speculation: `test_serve_engine.py`.
"""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_kit import ServeProcess, module_server  # noqa: E402

from kvcache.models import load_default_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "kvcache-default"
TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory)


@pytest.fixture(scope="module")
def reference():
    """`logp(prompt, answer)`: `[len(answer tokens), vocab]` log probabilities of each answer
    position, and the tokenizer."""
    model, tokenizer = load_default_model(dtype=torch.float64)

    def logp(prompt: str, answer: str) -> torch.Tensor:
        head, tail = tokenizer.encode(prompt), tokenizer.encode(answer)
        ids = torch.tensor([head + tail])
        with torch.no_grad():
            logits = model(ids, cache=model.new_cache(), position_ids=torch.arange(ids.shape[1])[None])
        return logits[0, len(head) - 1 : ids.shape[1] - 1].log_softmax(-1)

    return logp, tokenizer



def check_chat(content: list, text: str, expected: torch.Tensor, tokenizer, top: int, greedy: bool = True) -> None:
    """Chat `logprobs.content` against the reference: one entry per token of `text`, each token's
    log probability and its `top` alternatives (most likely first) as the reference has them."""
    assert "".join(entry.token for entry in content) == text and len(content) == expected.shape[0]
    for position, entry in enumerate(content):
        token = tokenizer.encode(entry.token)[0]
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert math.isclose(entry.logprob, float(expected[position, token]), abs_tol=TOLERANCE)
        values, ids = expected[position].topk(top)
        assert [tokenizer.encode(alt.token)[0] for alt in entry.top_logprobs] == ids.tolist()
        pairs = zip(entry.top_logprobs, values, strict=True)
        assert all(math.isclose(alt.logprob, float(v), abs_tol=TOLERANCE) for alt, v in pairs)
        if greedy:
            assert token == int(expected[position].argmax())


def test_chat_logprobs_equal_the_models_distribution_whole_and_streamed(server, reference) -> None:
    logp, tokenizer = reference
    c = server.client()
    messages = [{"role": "user", "content": "What is a list?"}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True,
                                      top_logprobs=3)  # fmt: skip
    text = whole.choices[0].message.content
    expected = logp("User: What is a list?\nAssistant:", text)
    check_chat(whole.choices[0].logprobs.content, text, expected, tokenizer, 3)
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True,
                                       top_logprobs=3, stream=True)  # fmt: skip
    pieces, content = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].logprobs is not None:
            content += chunk.choices[0].logprobs.content
    assert "".join(pieces) == text
    check_chat(content, text, expected, tokenizer, 3)
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_completion_logprobs_count_the_tokens_usage_counts(server, reference) -> None:
    """Completions' `logprobs: k`: tokens, their log probabilities, the top k as a mapping and the
    text offsets; cut by a stop string, one entry per token `usage` counts (the stop's last
    token included), streamed or whole alike."""
    logp, tokenizer = reference
    c = server.client()
    prompt = "The value of the "
    full = c.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, logprobs=2)
    text, given = full.choices[0].text, full.choices[0].logprobs
    expected = logp(prompt, text)
    assert "".join(given.tokens) == text and given.text_offset == list(range(len(text)))
    for position, (token, value, top) in enumerate(zip(given.tokens, given.token_logprobs, given.top_logprobs,
                                                       strict=True)):  # fmt: skip
        assert math.isclose(value, float(expected[position, tokenizer.encode(token)[0]]), abs_tol=TOLERANCE)
        values, ids = expected[position].topk(2)
        assert list(top) == [tokenizer.decode([i]) for i in ids.tolist()]
        pairs = zip(ids.tolist(), values, strict=True)
        assert all(math.isclose(top[tokenizer.decode([i])], float(v), abs_tol=TOLERANCE) for i, v in pairs)
    stop = text[10:12]
    for stream in (False, True):
        answer = c.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, logprobs=0, stop=stop,
                                      stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(answer)
            cut = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            given_in = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
            tokens = [t for g in given_in for t in g.tokens]
            offsets = [o for g in given_in for o in g.text_offset]
            used = chunks[-1].usage.completion_tokens
        else:
            cut, tokens = answer.choices[0].text, answer.choices[0].logprobs.tokens
            offsets, used = answer.choices[0].logprobs.text_offset, answer.usage.completion_tokens
        assert cut == text[: text.find(stop)] and len(tokens) == used and "".join(tokens).startswith(cut + stop)
        assert offsets == list(range(len(tokens)))


def test_sampled_tokens_carry_the_models_own_log_probabilities(server, reference) -> None:
    """At temperature 1.5 with a seed: each token's log probability is the model's (before the
    temperature), whichever token was drawn, and the alternatives are still the model's top ones."""
    logp, tokenizer = reference
    answer = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=20, temperature=1.5, seed=5, logprobs=True,
                                                    top_logprobs=2)  # fmt: skip
    text = answer.choices[0].message.content
    check_chat(answer.choices[0].logprobs.content, text, logp("User: Hi\nAssistant:", text), tokenizer, 2,
               greedy=False)  # fmt: skip


def test_logprob_requests_out_of_range_are_400s(server) -> None:
    cases = [("/v1/chat/completions", {"logprobs": 1}, "logprobs must be a boolean"),
             ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
             ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
             ("/v1/completions", {"logprobs": 21}, "logprobs must be in [0, 20]"),
             ("/v1/completions", {"logprobs": True}, "logprobs must be an integer"),
             ("/v1/completions", {"logprobs": 1, "top_logprobs": 1}, "top_logprobs is a chat field")]  # fmt: skip
    for path, extra, words in cases:
        body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
        answer = httpx.post(server.url + path, content=json.dumps({**body, **extra}).encode(), timeout=30,
                            headers={"content-type": "application/json"})  # fmt: skip
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], (extra, answer.text)


def test_several_prompts_and_n_choices_each_equal_their_request_alone(server, reference) -> None:
    """A completion's list of prompts (texts or token ids) times `n`: the choices in prompt order,
    `n` per prompt, each greedy text what the prompt alone gives, whole and streamed; usage counts
    each prompt once and every choice's tokens."""
    _, tokenizer = reference
    c = server.client()
    prompts = ["The value of the ", "A list is ", "When the module "]
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text for p in prompts]
    answer = c.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=12, temperature=0)
    assert [ch.index for ch in answer.choices] == list(range(6))
    assert [ch.text for ch in answer.choices] == [a for a in alone for _ in range(2)]
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    assert answer.usage.prompt_tokens == prompt_tokens and answer.usage.completion_tokens == 6 * 12
    by_ids = c.completions.create(model=MODEL, prompt=[tokenizer.encode(p) for p in prompts[:2]], max_tokens=12,
                                  temperature=0)  # fmt: skip
    assert [ch.text for ch in by_ids.choices] == alone[:2]
    streamed: dict[int, str] = {}
    finished: dict[int, str] = {}
    chunks = list(c.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))  # fmt: skip
    for chunk in chunks:
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert [streamed[i] for i in range(6)] == [a for a in alone for _ in range(2)]
    assert finished == dict.fromkeys(range(6), "length") and chunks[-1].usage.completion_tokens == 6 * 12


def test_n_seeded_chat_samples_are_the_requests_seeded_one_by_one(server) -> None:
    """Chat `n: 3` with a seed: choice j is what one request seeded `seed + j` samples."""
    c = server.client()
    messages = [{"role": "user", "content": "What is a key?"}]
    answer = c.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=20, temperature=1.2, seed=7)
    one_by_one = [c.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=1.2,
                                            seed=7 + j).choices[0].message.content for j in range(3)]  # fmt: skip
    assert [ch.message.content for ch in answer.choices] == one_by_one and len(set(one_by_one)) > 1


def generated(server: ServeProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    counts = [line.split()[1] for line in text.splitlines() if line.startswith("kvcache_generated_tokens_total")]
    return float(counts[0])


def test_a_client_that_leaves_a_stream_of_several_choices_cancels_every_row(server) -> None:
    """Every row of the answer leaves the batch: far fewer tokens decoded than its 4 x 4,000."""
    before = generated(server)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "The value of the ", "n": 4, "max_tokens": 4000, "stream": True}) as answer:
        assert answer.status_code == 200
        next(answer.iter_lines())
    deadline = time.monotonic() + 60
    while server.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.health()["running"] == 0 and generated(server) - before < 4000


@pytest.fixture(scope="module")
def scorer():
    """`score(ids)`: `[len(ids) - 1, vocab]` log probabilities of each prompt position after the
    first, from one forward over the whole prompt (float64, as the server runs the model)."""
    model, tokenizer = load_default_model(dtype=torch.float64)

    def score(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), cache=model.new_cache(), position_ids=torch.arange(len(ids))[None])
        return logits[0, :-1].log_softmax(-1)

    return score, tokenizer


def close_logprobs(given: list, expected: list) -> bool:
    """Two requests' log probabilities of the same tokens: equal within float64 rounding (the two
    may have been decoded in other forwards: a verify forward, a batch's step, a store hit)."""
    return len(given) == len(expected) and all(
        a is b is None or (a is not None and b is not None and math.isclose(a, b, abs_tol=TOLERANCE))
        for a, b in zip(given, expected, strict=True)
    )


def check_echoed(given, ids: list[int], expected: torch.Tensor, tokenizer, top: int) -> None:
    """The prompt's part of an echoed completion's `logprobs`: its first token has none, each later
    one the reference's log probability and its top alternatives."""
    n = len(ids)
    assert given.tokens[:n] == [tokenizer.decode([t]) for t in ids]
    assert given.token_logprobs[0] is None and given.top_logprobs[0] is None
    assert given.text_offset[:n] == list(range(n))  # (one character a token here)
    for i in range(1, n):
        assert math.isclose(given.token_logprobs[i], float(expected[i - 1, ids[i]]), abs_tol=TOLERANCE)
        values, alternatives = expected[i - 1].topk(top)
        assert list(given.top_logprobs[i]) == [tokenizer.decode([a]) for a in alternatives.tolist()]
        pairs = zip(alternatives.tolist(), values, strict=True)
        assert all(math.isclose(given.top_logprobs[i][tokenizer.decode([a])], float(v), abs_tol=TOLERANCE)
                   for a, v in pairs)  # fmt: skip


def test_echo_returns_the_prompt_and_its_log_probabilities_before_the_answer(server, scorer) -> None:
    """`echo` with `logprobs` (what lm-eval's completions backend sends to score a text: token ids,
    `max_tokens` 0 or 1): the text is the prompt's then the answer's, the log probabilities the
    prompt's (from one forward over it, the first token's null) then the answer's, whole and
    streamed alike; `usage` counts the answer's tokens only."""
    score, tokenizer = scorer
    c = server.client()
    text = "The value of the list is"
    ids = tokenizer.encode(text)
    expected = score(ids)
    for prompt in (text, ids):
        for max_tokens in (0, 1, 6):
            answer = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True,
                                          logprobs=2)  # fmt: skip
            choice, given = answer.choices[0], answer.choices[0].logprobs
            alone = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         logprobs=2) if max_tokens else None  # fmt: skip
            assert choice.text == text + (alone.choices[0].text if alone else "")
            check_echoed(given, ids, expected, tokenizer, 2)
            assert len(given.tokens) == len(ids) + max_tokens and answer.usage.completion_tokens == max_tokens
            if alone:
                rest = alone.choices[0].logprobs
                assert close_logprobs(given.token_logprobs[len(ids) :], rest.token_logprobs)
                assert given.text_offset[len(ids) :] == [len(text) + o for o in rest.text_offset]
            assert choice.finish_reason == "length"
    chunks = list(c.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0, echo=True, logprobs=2,
                                       stream=True))  # fmt: skip
    whole = c.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0, echo=True, logprobs=2)
    assert chunks[0].choices[0].text == text  # the prompt comes first, with its log probabilities
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [v for ch in chunks if ch.choices[0].logprobs for v in getattr(ch.choices[0].logprobs, field)]
        expected_field = getattr(whole.choices[0].logprobs, field)
        if field == "token_logprobs":
            assert close_logprobs(streamed, expected_field)
        elif field == "top_logprobs":
            assert [None if t is None else list(t) for t in streamed] == \
                [None if t is None else list(t) for t in expected_field]  # fmt: skip
            assert all(a is b is None or close_logprobs(list(a.values()), list(b.values()))
                       for a, b in zip(streamed, expected_field, strict=True))  # fmt: skip
        else:
            assert streamed == expected_field
    plain = c.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(text) and plain.choices[0].logprobs is None
    unset = c.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, extra_body={"echo": None})
    assert text + unset.choices[0].text == plain.choices[0].text  # null is the default: no echo


def test_echo_requests_out_of_range_are_400s(server) -> None:
    """Only a completion echoes (chat's `echo` stays off), `echo` is a boolean, and only an echo
    may ask for no new token."""
    cases = [("/v1/completions", {"echo": "yes"}, "echo must be a boolean"),
             ("/v1/completions", {"max_tokens": 0}, "max_tokens must be in [1,"),
             ("/v1/completions", {"echo": True, "max_tokens": -1}, "max_tokens must be in [0,"),
             ("/v1/chat/completions", {"echo": True}, "echo=True is not supported")]  # fmt: skip
    for path, extra, words in cases:
        body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
        answer = httpx.post(server.url + path, content=json.dumps({**body, **extra}).encode(), timeout=30,
                            headers={"content-type": "application/json"})  # fmt: skip
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], (extra, answer.text)


def test_prompt_log_probabilities_of_a_prompt_longer_than_a_block(scorer) -> None:
    """`prompt_logprobs` reads a long prompt a block at a time (`PROMPT_BLOCK` positions a forward,
    the logits of one block held at once): every position still gets what one forward over the
    whole prompt gives, across the blocks' seams."""
    from kvcache.serve.logprobs import PROMPT_BLOCK, prompt_logprobs

    score, tokenizer = scorer
    model, _ = load_default_model(dtype=torch.float64)
    ids = tokenizer.encode("The list holds a value. " * 20)[: 2 * PROMPT_BLOCK + 7]
    expected = score(ids)
    with torch.no_grad():
        given = prompt_logprobs(model, ids, 3, torch.device("cpu"))
    assert [g.token for g in given] == ids[1:]
    for i, entry in enumerate(given):
        assert math.isclose(entry.logprob, float(expected[i, ids[i + 1]]), abs_tol=TOLERANCE)
        values, alternatives = expected[i].topk(3)
        assert [a for a, _ in entry.top] == alternatives.tolist()
        assert all(math.isclose(v, float(w), abs_tol=TOLERANCE) for (_, v), w in zip(entry.top, values, strict=True))


def test_logit_bias_bans_and_forces_tokens_chat_and_completions(server, reference) -> None:
    """`logit_bias` through the official client: banning the first token of the greedy answer gives
    the model's second choice there and never that token again; +100 forces a token at every
    step; log probabilities stay the model's own (before the bias); chat takes it too."""
    logp, tokenizer = reference
    c = server.client()
    prompt = "The value of the "
    text = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    first = tokenizer.encode(text)[0]
    banned = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                                  logit_bias={str(first): -100})  # fmt: skip
    ids = tokenizer.encode(banned.choices[0].text)
    expected = logp(prompt, banned.choices[0].text)
    assert ids[0] == int(expected[0].topk(2).indices[1]) and first not in ids
    assert math.isclose(banned.choices[0].logprobs.token_logprobs[0], float(expected[0, ids[0]]), abs_tol=TOLERANCE)
    forced = tokenizer.encode("q")[0]
    answer = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.8, seed=3,
                                  logit_bias={str(forced): 100})  # fmt: skip
    assert answer.choices[0].text == "q" * 5
    messages = [{"role": "user", "content": "Hi"}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                     logit_bias={str(forced): 100})  # fmt: skip
    assert chat.choices[0].message.content == "q" * 5


def test_logit_bias_out_of_range_is_a_400(server) -> None:
    cases = [({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
             ({"logit_bias": {"1": 101}}, "logit_bias values must be numbers in [-100, 100]"),
             ({"logit_bias": {"1": True}}, "logit_bias values must be numbers"),
             ({"logit_bias": [1, 2]}, "logit_bias must be an object"),
             ({"logit_bias": {"99999999": 1}}, "logit_bias token ids must be in [0,")]  # fmt: skip
    for extra, words in cases:
        answer = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "x", **extra}).encode(),
                            timeout=30, headers={"content-type": "application/json"})  # fmt: skip
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], (extra, answer.text)


def test_presence_and_frequency_penalties_through_the_official_client(server, reference) -> None:
    """OpenAI's penalties: each greedy token is the argmax of the model's log probabilities less
    `frequency_penalty` per earlier occurrence in the answer and `presence_penalty` once (the
    answer changes where the plain one repeats itself); log probabilities stay the model's own;
    chat takes them too; out of [-2, 2] they are 400s."""
    logp, tokenizer = reference
    c = server.client()
    prompt = "Hello Hello Hello "
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert len(set(tokenizer.encode(plain))) < len(tokenizer.encode(plain))  # it repeats: penalties must bite
    for presence, frequency in ((0.0, 1.5), (2.0, 0.0), (0.5, -0.5)):
        answer = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=1,
                                      presence_penalty=presence, frequency_penalty=frequency)  # fmt: skip
        text = answer.choices[0].text
        ids, expected = tokenizer.encode(text), logp(prompt, text)
        counts = torch.zeros(expected.shape[-1], dtype=torch.float64)
        for i, token in enumerate(ids):
            assert token == int((expected[i] - frequency * counts - presence * (counts > 0)).argmax()), (i, text)
            assert math.isclose(answer.choices[0].logprobs.token_logprobs[i], float(expected[i, token]),
                                abs_tol=TOLERANCE)  # fmt: skip
            counts[token] += 1
        assert text != plain
    messages = [{"role": "user", "content": "Hello Hello Hello"}]
    chats = [c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                       frequency_penalty=penalty).choices[0].message.content for penalty in (0, 2)]
    assert chats[0] != chats[1]
    for bad in (2.5, -3, "1", True):
        answer = httpx.post(server.url + "/v1/completions", timeout=30, headers={"content-type": "application/json"},
                            content=json.dumps({"prompt": "x", "frequency_penalty": bad}).encode())  # fmt: skip
        assert answer.status_code == 400 and "frequency_penalty" in answer.json()["error"]["message"], bad


def test_log_probabilities_that_are_not_json_numbers_are_sent_as_the_floor() -> None:
    """-inf (a token banned or ruled out) and NaN (logits a model computed as NaN) are not JSON
    numbers: both objects send OpenAI's floor, -9999.0, where `json.dumps(..., allow_nan=False)`
    would fail (Starlette's encoder refuses them: a 500)."""
    from kvcache.serve.logprobs import TokenLogprobs, chat_logprobs, completion_logprobs

    given = [TokenLogprobs(3, float("nan"), ((3, float("nan")), (4, float("-inf")))), TokenLogprobs(5, -0.5, ())]
    chat = chat_logprobs(given, lambda ids: "x" * len(ids))
    completion = completion_logprobs(given, lambda ids: "x" * len(ids))
    for shaped in (chat, completion):
        json.dumps(shaped, allow_nan=False)
    assert [e["logprob"] for e in chat["content"]] == [-9999.0, -0.5]
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-9999.0, -9999.0]
    assert completion["token_logprobs"] == [-9999.0, -0.5]
