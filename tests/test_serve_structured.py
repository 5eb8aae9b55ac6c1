"""Structured outputs in `kvcache serve` (`response_format`, the Responses API's `text.format`):
the grammar's token masks against JSON itself (every token of a conforming document allowed, in
turn, and the document's end ending it; a token that breaks it never allowed), the engine's
constrained answers against a plain recomputation without a cache that masks with its own
llguidance matcher (plain and speculative engines, batched), and the official client's requests,
whole, streamed and through the Responses API, with bad formats as 400s naming the field.
The bundled model in float64 (batched and single-row kernels agree far below its logit gaps)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

llguidance = pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from serve_kit import module_server  # noqa: E402
from test_serve_engine import run_requests  # noqa: E402

from kvcache.generation.sampling import Sampling  # noqa: E402
from kvcache.models.text_model import bundled  # noqa: E402
from kvcache.serve.engine import Engine, Request  # noqa: E402
from kvcache.serve.grammar import Constraint, grammar_of, grammar_tokenizer  # noqa: E402
from kvcache.serve.schema import ApiError, Limits, chat_params  # noqa: E402
from kvcache.store import PrefixStore  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
AS_PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def served():
    return bundled(torch.float64)


def is_person(value: object) -> bool:
    return isinstance(value, dict) and set(value) == {"name", "age"} and isinstance(value["name"], str) \
        and len(value["name"]) <= 12 and type(value["age"]) is int  # fmt: skip


# ------------------------------------------------------------------------------- the grammar
names = st.text(st.sampled_from("abcxyz XYZ019-_.,!'"), max_size=12)


@settings(max_examples=60, deadline=None)
@given(name=names, age=st.integers(-10**6, 10**6), indent=st.sampled_from([None, 2, 4]))
def test_a_conforming_document_is_allowed_token_by_token_and_ends_the_answer(served, name, age, indent) -> None:
    """Each token of a document that conforms (its keys in the schema's order, as OpenAI's
    structured outputs write them; compact or indented) is allowed when it comes, the answer is
    done exactly at its end, and a token that would break it is masked."""
    text = json.dumps({"name": name, "age": age}, indent=indent)
    constraint = Constraint(grammar_tokenizer(served), grammar_of(AS_PERSON), served.model.vocab_size)
    tokens = served.encode(text)
    for i, token in enumerate(tokens):
        assert not constraint.done and bool(constraint.allowed[token]), (text, i)
        constraint.accept(token)
    assert constraint.done
    fresh = Constraint(grammar_tokenizer(served), grammar_of(AS_PERSON), served.model.vocab_size)
    for bad in ("[", "x", "}", '"'):  # a document starts with "{" only; then a key, not "}" (both are required)
        assert not fresh.allowed[served.encode(bad)[0]]
    fresh.accept(served.encode("{")[0])
    assert not fresh.allowed[served.encode("}")[0]] and fresh.allowed[served.encode('"')[0]]
    for token in served.encode('"age'):  # (a key out of the schema's order)
        assert not fresh.done
        if not fresh.allowed[token]:
            break
        fresh.accept(token)
    else:
        raise AssertionError("the second key was allowed first")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json"}}, "response_format"),
    ({"response_format": "json_object"}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "response_format"),
])  # fmt: skip
def test_bad_response_formats_are_400s_naming_the_field(body, param) -> None:
    with pytest.raises(ApiError) as caught:
        chat_params({"messages": [{"role": "user", "content": "hi"}], **body}, "m", Limits())
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_text_is_no_grammar_and_json_is_one() -> None:
    chat = lambda **body: chat_params({"messages": [{"role": "user", "content": "hi"}], **body}, "m", Limits())  # noqa: E731
    assert chat().grammar is None and chat(response_format={"type": "text"}).grammar is None
    assert chat(response_format={"type": "json_object"}).grammar and chat(response_format=AS_PERSON).grammar


# ------------------------------------------------------------------------------ the engine
def reference(served, prompt: list[int], grammar: str, n: int) -> list[int]:
    """Greedy decoding held to `grammar`, recomputed from the whole sequence at every step (no
    cache) and masked by a matcher of its own: the tokens, up to the grammar's end or `n`."""
    matcher = llguidance.LLMatcher(grammar_tokenizer(served), grammar, log_level=0)
    model, vocab, ids = served.model, served.model.vocab_size, list(prompt)
    while len(ids) - len(prompt) < n and not matcher.is_stopped():
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1]
        allowed = torch.tensor(list(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
        if not allowed.any():
            break
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        assert matcher.consume_token(token)
        ids.append(token)
    return ids[len(prompt) :]


@pytest.mark.parametrize("speculative", [0, 4], ids=["plain", "speculative"])
def test_constrained_answers_equal_a_plain_recomputation_held_to_the_grammar(served, speculative: int) -> None:
    """Six requests at once, constrained (JSON, a schema) and not, greedy: each constrained answer
    is the grammar-masked greedy recomputation; the others are as they would be without any."""
    engine = Engine(served.model, PrefixStore(chunk_size=16), eos=[], speculative=speculative,
                    draft_schedule="constant", grammar_tokenizer=lambda: grammar_tokenizer(served))  # fmt: skip
    texts = ["Give me a person as JSON: ", "A person: ", "The value of the list is ", "A record, please.\n"]
    grammars = [grammar_of(AS_PERSON), grammar_of({"type": "json_object"}), None, grammar_of(AS_PERSON)]
    prompts = [served.encode(t) for t in texts]
    engine.start()
    try:
        requests = [Request(prompt=p, max_tokens=40, sampling=Sampling(False), grammar=g)
                    for p, g in zip(prompts, grammars, strict=True)]  # fmt: skip
        outcomes = run_requests(engine, requests)
    finally:
        engine.stop()
    for prompt, grammar, request, outcome in zip(prompts, grammars, requests, outcomes, strict=True):
        if grammar is None:
            assert len(request.tokens) == 40 and outcome.events[-1] == ("done", "length")
            continue
        want = reference(served, prompt, grammar, 40)
        assert request.tokens == want
        finished = outcome.events[-1]
        assert finished == (("done", "stop") if len(want) < 40 else finished)


# ------------------------------------------------------------------------------ served
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory)


def test_the_official_client_gets_answers_held_to_the_format_whole_streamed_and_as_responses(served, server) -> None:
    """Each answer is the constrained greedy recomputation of its prompt: JSON mode, a schema, and
    a schema asked through the Responses API; streamed pieces join to the whole answer."""
    c = server.client()
    messages = [{"role": "user", "content": "Give me a person as JSON."}]
    prompt = served.encode(served.chat_prompt(messages))
    for form in ({"type": "json_object"}, AS_PERSON):
        want = served.decode(reference(served, prompt, grammar_of(form), 120))
        whole = c.chat.completions.create(model="kvcache-default", messages=messages, response_format=form,
                                          temperature=0, max_tokens=120)  # fmt: skip
        assert whole.choices[0].message.content == want
        if whole.choices[0].finish_reason == "stop":  # the grammar ended: a whole document
            document = json.loads(want)
            assert isinstance(document, dict) and (form is not AS_PERSON or is_person(document))
        pieces = c.chat.completions.create(model="kvcache-default", messages=messages, response_format=form,
                                           temperature=0, max_tokens=120, stream=True)  # fmt: skip
        assert "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices) == want
    flat = {"type": "json_schema", "name": "person", "schema": PERSON}
    answer = c.responses.create(model="kvcache-default", input=messages, text={"format": flat}, temperature=0,
                                max_output_tokens=120)  # fmt: skip
    assert answer.output_text == served.decode(reference(served, prompt, grammar_of(AS_PERSON), 120))
    with pytest.raises(openai.BadRequestError) as caught:
        c.responses.create(model="kvcache-default", input="hi", text={"format": {"type": "json_schema"}})
    assert caught.value.body["param"].startswith("text")


def test_sampled_answers_follow_the_schema(server) -> None:
    """Sampled (seeded) answers differ from one another, and each is the schema's, as far as it got."""
    c = server.client()
    answer = c.chat.completions.create(model="kvcache-default", messages=[{"role": "user", "content": "A person?"}],
                                       response_format=AS_PERSON, temperature=1.0, seed=5, n=4,
                                       max_tokens=200)  # fmt: skip
    texts = [choice.message.content for choice in answer.choices]
    assert len(set(texts)) > 1
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            assert is_person(json.loads(choice.message.content))
        else:
            assert choice.message.content.lstrip().startswith("{")


def test_a_transformers_tokenizer_is_held_to_the_schema_too(tmp_path_factory) -> None:
    """A local transformers model's tokenizer (byte-level BPE): a conforming document's tokens are
    allowed in turn and end the answer; its end token is allowed only once the document ended."""
    pytest.importorskip("transformers")
    from serve_kit import tiny_model_dir

    from kvcache.models.text_model import from_directory

    served = from_directory(tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny"))
    vocab = served.model.vocab_size
    for indent in (None, 2):
        constraint = Constraint(grammar_tokenizer(served), grammar_of(AS_PERSON), vocab)
        text = json.dumps({"name": "Ada Lovelace", "age": 36}, indent=indent)
        for token in served.encode(text, add_special_tokens=False):
            assert bool(constraint.allowed[token]) and not constraint.done
            assert not any(constraint.allowed[end] for end in served.eos if end < vocab)
            constraint.accept(token)
        assert constraint.done


def test_the_tokenizer_is_built_once_in_the_background_and_its_failure_raised_where_needed() -> None:
    from kvcache.errors import CacheInputError
    from kvcache.serve.grammar import TokenizerInBackground

    calls = []
    ready = TokenizerInBackground(lambda: calls.append(1) or "tokens")
    ready.start()
    assert ready.get() == ready.get() == "tokens" and calls == [1]
    assert TokenizerInBackground(lambda: "never started").get() == "never started"

    def refuse():
        raise CacheInputError("structured outputs need llguidance")

    failing = TokenizerInBackground(refuse)
    failing.start()
    for _ in range(2):
        with pytest.raises(CacheInputError, match="llguidance"):
            failing.get()
    engine = Engine(bundled().model, PrefixStore(chunk_size=16), eos=[])  # built without structured outputs
    engine.start()
    try:
        request = Request(prompt=[1, 2, 3], max_tokens=4, sampling=Sampling(False), grammar=grammar_of(AS_PERSON))
        (outcome,) = run_requests(engine, [request])
        assert outcome.events[-1][0] == "error" and "structured outputs" in outcome.events[-1][1]
    finally:
        engine.stop()
