"""Tool calls in `kvcache serve`'s chat completions: the reader that takes calls out of an answer's
text (any split of a text read as the whole; calls written as markup read back as the template
wrote them), the checks of `tools` and of a conversation's tool turns, and a served model that
calls tools (`tool_model`: trained here to write calls as Qwen 3's, Qwen 3.5's, Llama 3's or
Gemma 4's template asks)
through the official `openai` client, whole and streamed: the calls it wrote, its
text around them, and its reply to a tool's result, each what it was trained to write (which it
writes only if the server rendered the tools and the tool turns as its template does)."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_kit import ServeProcess, module_server  # noqa: E402
from tool_model import (  # noqa: E402
    GEMMA_TAGS,
    GEMMA_TEMPLATE,
    MARKUP_TEMPLATE,
    PYTHONIC_TAGS,
    PYTHONIC_TEMPLATE,
    TOOLS,
    WEATHER,
    called,
    conversations,
    nested,
    read_styled,
    styled_tokenizer,
    template_messages,
    tool_model_dir,
)

from kvcache.serve.gemma_calls import CLOSE as GEMMA_CLOSE  # noqa: E402
from kvcache.serve.gemma_calls import OPEN as GEMMA_OPEN  # noqa: E402
from kvcache.serve.gemma_calls import QUOTE  # noqa: E402
from kvcache.serve.mistral_calls import MistralCallReader  # noqa: E402
from kvcache.serve.pythonic_calls import CLOSE as PYTHONIC_CLOSE  # noqa: E402
from kvcache.serve.pythonic_calls import OPEN as PYTHONIC_OPEN  # noqa: E402
from kvcache.serve.reasoning import (  # noqa: E402
    BRACKET_THINK,
    BRACKET_UNTHINK,
    CHANNEL,
    THINK,
    UNCHANNEL,
    UNTHINK,
    Reasoning,
    ReasoningReader,
    closing,
    opened_in,
)
from kvcache.serve.schema import ApiError, Limits, chat_params, completion_params  # noqa: E402
from kvcache.serve.tools import CLOSE, OPEN, BareCallReader, ToolCall, ToolCallReader  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------- the reader
def cut(text: str, cuts: list[int]) -> list[str]:
    """`text` cut at the positions `cuts` (those past its end at its end)."""
    bounds = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]


def read(pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """The content and the calls (name, arguments) a reader gives for `pieces` fed in turn."""
    reader = ToolCallReader()
    parts = [part for piece in pieces for part in reader.feed(piece)] + reader.finish()
    calls = [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)]
    assert reader.calls == len(calls)
    return "".join(p for p in parts if isinstance(p, str)), calls


words = st.text(st.sampled_from("ab <>_/{}\"tool"), min_size=1, max_size=12).map(str.strip).filter(
    lambda s: s and OPEN not in s and not OPEN.startswith(s[-min(len(s), 10):]))  # fmt: skip
arguments = st.dictionaries(st.sampled_from(["city", "n", "q"]), st.one_of(st.integers(), st.text(max_size=5)),
                            max_size=2)  # fmt: skip
calls = st.tuples(st.sampled_from(["get_weather", "search"]), arguments)
layout = st.sampled_from(["", "\n", " \n", "\n\n"])


@st.composite
def answers(draw) -> tuple[str, str, list[tuple[str, dict]]]:
    """An answer written from parts (text never next to text), its content and calls as the module
    docstring of `kvcache.serve.tools` defines them: the texts, the calls, layout dropped."""
    parts = draw(st.lists(st.one_of(words, calls), max_size=5).filter(
        lambda ps: not any(isinstance(a, str) and isinstance(b, str) for a, b in itertools.pairwise(ps))))  # fmt: skip
    text, content, made = "", "", []
    for part in parts:
        if isinstance(part, str):
            text, content = text + part, content + part
        else:
            body = json.dumps({"name": part[0], "arguments": part[1]}, ensure_ascii=False)
            text += draw(layout) + OPEN + draw(st.sampled_from(["", "\n"])) + body + "\n" + CLOSE + draw(layout)
            made.append(part)
    return text, content if made else text, made


@settings(max_examples=150, deadline=None)
@given(answers(), st.lists(st.integers(0, 200), max_size=6))
def test_the_reader_gives_each_answers_calls_and_text_for_any_split(answer, cuts) -> None:
    text, content, made = answer
    pieces = cut(text, cuts)
    assert read([text]) == (content, made)
    assert read(pieces) == (content, made)
    assert read(list(text)) == (content, made)


def test_a_call_that_is_not_json_or_never_closes_stays_text() -> None:
    assert read(["Hi ", OPEN, "not json", CLOSE]) == ("Hi" + OPEN + "not json" + CLOSE, [])
    assert read(['x\n<tool_call>{"name": 3}</tool_call>']) == ('x<tool_call>{"name": 3}</tool_call>', [])
    assert read(["ok\n<tool_call>\n{\"name\": \"f\""]) == ("ok<tool_call>\n{\"name\": \"f\"", [])
    assert read(["a <tool", "_cal"]) == ("a <tool_cal", [])  # the start of a tag, then not
    # arguments given as JSON text, or as `parameters` (Llama's name for them), read as an object
    assert read([OPEN + '{"name": "f", "arguments": "{\\"a\\": 1}"}' + CLOSE]) == ("", [("f", {"a": 1})])
    assert read([OPEN + '{"name": "f", "parameters": {"a": 1}}' + CLOSE]) == ("", [("f", {"a": 1})])


@st.composite
def bare_answers(draw) -> tuple[str, str, list[tuple[str, dict]]]:
    """An answer as Llama 3's template asks (calls alone, `;` between), or text; its content and calls."""
    made = draw(st.lists(calls, max_size=3))
    if not made or draw(st.booleans()):  # text (perhaps a call with something after it: not calls alone)
        text = draw(words) if not made else json.dumps({"name": made[0][0], "parameters": made[0][1]}) + " ok"
        return text, text, []
    parts = [json.dumps({"name": name, "parameters": args}, ensure_ascii=False) for name, args in made]
    return draw(layout) + draw(st.sampled_from(["; ", ";", "\n"])).join(parts) + draw(layout), "", made


@settings(max_examples=100, deadline=None)
@given(bare_answers(), st.lists(st.integers(0, 120), max_size=5))
def test_bare_calls_are_the_whole_answer_for_any_split(answer, cuts) -> None:
    text, content, made = answer
    pieces = cut(text, cuts)
    for split in ([text], pieces, list(text)):
        reader = BareCallReader()
        parts = [part for piece in split for part in reader.feed(piece)] + reader.finish()
        assert "".join(p for p in parts if isinstance(p, str)) == content
        assert [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)] == made


# A tool whose parameters take every JSON Schema type (an Optional[str] too)
TYPED = {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"},
    "dry_run": {"type": "boolean"}, "note": {"type": ["string", "null"]}, "options": {"type": "object"},
    "lines": {"type": "array"}, "nothing": {"type": "null"}}}}}  # fmt: skip
plain_text = st.text(st.sampled_from("ab <>=/_\n\"{}[]:"), max_size=12).filter(lambda t: "</parameter>" not in t)
values = {"path": plain_text, "line": st.integers(-(2**70), 2**70),
          "scale": st.floats(allow_nan=False, allow_infinity=False, width=64), "dry_run": st.booleans(),
          "note": st.one_of(st.none(), plain_text.filter(lambda t: t.strip() != "null")),
          "options": st.dictionaries(st.text(max_size=3), st.one_of(st.integers(), st.text(max_size=3)), max_size=2),
          "lines": st.lists(st.one_of(st.integers(), st.booleans(), st.text(max_size=3)), max_size=3),
          "nothing": st.none()}  # fmt: skip


@pytest.fixture(scope="module")
def markup_tokenizer(tmp_path_factory):
    """A tokenizer whose chat template writes calls as Qwen 3.5's markup (`tool_model`'s)."""
    transformers = pytest.importorskip("transformers")
    from serve_kit import byte_level_bpe

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(["ab"], 270, ["<unk>"]),
                                                     unk_token="<unk>")  # fmt: skip
    tokenizer.chat_template = MARKUP_TEMPLATE
    return tokenizer


@settings(max_examples=100, deadline=None)
@given(st.fixed_dictionaries({}, optional=values))
def test_a_call_written_as_markup_is_read_back_as_the_template_wrote_it(markup_tokenizer, arguments) -> None:
    """Arguments of every type through the template itself (a string as it is, the rest as JSON, a
    newline around each value) and back through the reader: the same arguments, typed by the tool's
    schema."""
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "edit", "arguments": arguments}}]}  # fmt: skip
    text = markup_tokenizer.apply_chat_template([turn], tokenize=False)
    reader = ToolCallReader([TYPED])
    calls = [p for p in [*reader.feed(text), *reader.finish()] if isinstance(p, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("edit", arguments)]


@pytest.fixture(scope="module")
def gemma_tokenizer():
    """A tokenizer whose chat template writes calls as Gemma 4's does (`tool_model`'s), its tags special tokens."""
    return styled_tokenizer(GEMMA_TAGS, GEMMA_TEMPLATE)


gemma_text = st.text(st.sampled_from('ab <>=/_\n"{}[]:,|'), max_size=10).filter(lambda t: QUOTE not in t)
gemma_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), gemma_text,
                       st.floats(allow_nan=False, allow_infinity=False, width=64))  # fmt: skip
gemma_keys = st.text(st.sampled_from("abcxyz_09"), min_size=1, max_size=6)


gemma_values = st.recursive(gemma_leaf, nested(gemma_keys), max_leaves=8)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(gemma_keys, gemma_values, max_size=4), st.lists(st.integers(0, 300), max_size=5))
def test_a_gemma_call_is_read_back_as_the_template_wrote_it(gemma_tokenizer, arguments, cuts) -> None:
    """Arguments of every JSON type, nested, through a template that writes them as Gemma 4's does
    (strings between `<|"|>`, keys bare, objects and arrays in braces and brackets) and back through
    the reader, whole and cut anywhere: the same arguments; the text around the call is content."""
    turn = {"role": "assistant", "content": "Done.", "tool_calls": [
        {"type": "function", "function": {"name": "edit", "arguments": arguments}}]}  # fmt: skip
    text = gemma_tokenizer.apply_chat_template([turn], tokenize=False)
    assert text.count(GEMMA_OPEN) == 1
    for pieces in ([text], cut(text, cuts)):
        reader = ToolCallReader(None, "gemma")
        parts = [part for piece in pieces for part in reader.feed(piece)] + reader.finish()
        assert [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)] == [("edit", arguments)]
        before, after = text[: text.index(GEMMA_OPEN)], text[text.index(GEMMA_CLOSE) + len(GEMMA_CLOSE) :]
        assert "".join(p for p in parts if isinstance(p, str)) == before.rstrip() + after  # (layout next to a call)


def test_what_is_not_one_gemma_call_stays_text() -> None:
    def one(text: str) -> tuple[str, list[tuple[str, dict]]]:
        return read_styled(text, "gemma")

    q = QUOTE
    assert one(f"{GEMMA_OPEN}call:f{{a:{q}x{q},b:[1, 2.5, true],c:{{d:null}}}}{GEMMA_CLOSE}") == (
        "", [("f", {"a": "x", "b": [1, 2.5, True], "c": {"d": None}})])
    assert one(f'{GEMMA_OPEN} call:f {{ "a" : "x" }} {GEMMA_CLOSE}') == ("", [("f", {"a": "x"})])  # JSON strings
    assert one(f"{GEMMA_OPEN}call:f{{a:None,b:[None]}}{GEMMA_CLOSE}") == ("", [("f", {"a": None, "b": [None]})])
    for body in ("call:f{a:word}", f"call:f{{a:{q}x}}", "call:f{a:1", "call:f{a:1}x", "call:f[1]", "f{a:1}",
                 "call:f{a 1}", "call:f{a:1 b:2}", "call:{a:1}"):  # fmt: skip
        assert one(f"Hi {GEMMA_OPEN}{body}{GEMMA_CLOSE}") == (f"Hi{GEMMA_OPEN}{body}{GEMMA_CLOSE}", [])
    assert one(f"Hi {GEMMA_OPEN}call:f{{a:1}}") == (f"Hi{GEMMA_OPEN}call:f{{a:1}}", [])  # never closed


@pytest.fixture(scope="module")
def pythonic_tokenizer():
    """A tokenizer whose chat template writes calls as LFM2's does (`tool_model`'s), its tags special tokens."""
    return styled_tokenizer(PYTHONIC_TAGS, PYTHONIC_TEMPLATE)


python_text = st.text(max_size=8)  # any characters: the template writes them as a JSON string, a Python literal


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(gemma_keys.filter(str.isidentifier), st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), python_text,
              st.floats(allow_nan=False, allow_infinity=False, width=64)),
    nested(python_text),
    max_leaves=8), max_size=3), min_size=1, max_size=3), st.lists(st.integers(0, 300), max_size=5))  # fmt: skip
def test_pythonic_calls_are_read_back_as_the_template_wrote_them(pythonic_tokenizer, arguments, cuts) -> None:
    """One turn's calls (one to three) with arguments of every JSON type, nested, through a template
    that writes them as LFM2's does (one Python list of keyword calls, values as Python literals)
    and back through the reader, whole and cut anywhere: the same calls, in order."""
    turn = {"role": "assistant", "content": "Done.", "tool_calls": [
        {"type": "function", "function": {"name": f"f{i}", "arguments": a}}
        for i, a in enumerate(arguments)]}  # fmt: skip
    text = pythonic_tokenizer.apply_chat_template([turn], tokenize=False)
    for pieces in ([text], cut(text, cuts)):
        reader = ToolCallReader(None, "pythonic")
        parts = [part for piece in pieces for part in reader.feed(piece)] + reader.finish()
        assert [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)] == [
            (f"f{i}", a) for i, a in enumerate(arguments)]  # fmt: skip
        assert reader.calls == len(arguments)


def test_what_is_not_a_list_of_pythonic_calls_stays_text() -> None:
    def one(text: str) -> tuple[str, list[tuple[str, dict]]]:
        return read_styled(text, "pythonic")

    o, c = PYTHONIC_OPEN, PYTHONIC_CLOSE
    assert one(f"{o}f(a=true, b=null, c=(1, 2), d={{'k': -1.5}}){c}") == (
        "", [("f", {"a": True, "b": None, "c": [1, 2], "d": {"k": -1.5}})])  # JSON spellings, a bare call
    assert one(f'{o}[{{"name": "f", "arguments": {{"a": [true, null]}}, "id": "x"}}, g(b=\'y\')]{c}') == (
        "", [("f", {"a": [True, None]}), ("g", {"b": "y"})])  # calls written as JSON objects (as some templates do)
    for body in ("[f(1)]", '[{"name": "f", "arguments": [1]}]', '[{"name": 1}]', '[{"name": "f", "x": 1}]',
                 "[f(a=x)]", "[f(a=1+2)]", "[os.system(a='x')]", "[f(**k)]", "[]", "[f(a={1, 2})]",
                 "[f(a=1e999)]", "[f(a={1: 2})]", "f(a=1); g()", "[f(a=1)", "['f']", "[f(a=b'x')]",
                 "__import__('os')"):  # fmt: skip
        assert one(f"Hi {o}{body}{c}") == (f"Hi{o}{body}{c}", [])


@settings(max_examples=100, deadline=None)
@given(st.lists(calls, min_size=1, max_size=3), st.booleans(), st.sampled_from(["", "Sure.", "Let me see.\n"]),
       st.lists(st.integers(0, 200), max_size=5))  # fmt: skip
def test_mistral_calls_run_to_the_answers_end_in_either_format(made, listed, before, cuts) -> None:
    """What follows `[TOOL_CALLS]` to the end of the answer, written as v3 templates write it (a
    JSON list) or as v11 ones do (`NAME[ARGS]{...}` after each `[TOOL_CALLS]`), cut anywhere: the
    calls, and the text before them as content; each call with a nine-character id."""
    if listed:
        text = before + "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in made])
    else:
        text = before + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in made)
    for pieces in ([text], cut(text, cuts), list(text)):
        reader = MistralCallReader()
        parts = [part for piece in pieces for part in reader.feed(piece)] + reader.finish()
        assert [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)] == made
        assert "".join(p for p in parts if isinstance(p, str)) == before.rstrip()
        assert all(re.fullmatch("[0-9a-z]{9}", p.shaped()["id"]) for p in parts if isinstance(p, ToolCall))
    for body in ("f[ARGS]{", "f[ARGS][1]", "[1]", '{"name": 3}', "f g[ARGS]{}", '[{"name": "f"}] x', ""):
        reader = MistralCallReader()
        parts = [*reader.feed("Hi [TOOL_CALLS]" + body), *reader.finish()]
        assert parts == ["Hi", "[TOOL_CALLS]" + body]  # not calls: the text as written


@pytest.mark.parametrize("template, style", [
    ('{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{"name": <name>}</tool_call>', "json"),
    ("{{ tools }}<tool_call>\n<function=<name>>\n</function>\n</tool_call>", "markup"),
    ('{{ tools }}Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
     'value}.', "bare"),
    ("{{ tools }}{{ '<|tool_call>call:' + name }}{{ args }}{{ '<tool_call|>' }}", "gemma"),
    ('{% if tools %}List of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|>{% endif %}', "pythonic"),
    ("{{ tools }}<|tool_call_start|>[{{ name }}()]<|tool_call_end|>", "pythonic"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS] [", "mistral"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]{{ name }}[ARGS]", "mistral-args"),
    ("{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}", None),
])  # fmt: skip
def test_each_template_is_served_in_the_call_format_it_writes(template, style) -> None:
    """Which format a chat template's calls are read in (fragments as each family's templates write
    them; LFM2's may write the tool list alone), and a template that writes none refuses tools."""
    from types import SimpleNamespace

    from kvcache.serve.tools import PARSERS, call_style, parser_refused, tools_refused

    served = SimpleNamespace(kind="transformers", tokenizer=SimpleNamespace(chat_template=template,
                                                                            all_special_tokens=[]))  # fmt: skip
    assert (tools_refused(served) is None) == (style is not None)
    if style is not None:
        assert call_style(served) == style
    # vLLM's --tool-call-parser names: taken where they name the template's format, refused otherwise
    for name, parsed in PARSERS.items():
        refused = parser_refused(served, name)
        if style is None:
            assert "does not write tools" in refused
        else:
            assert (refused is None) == (parsed == style.replace("mistral-args", "mistral")), (name, refused)
            assert refused is None or "writes calls in another format" in refused
    assert "not a call format this server reads" in parser_refused(served, "granite")


def test_markup_values_are_typed_by_the_schema_and_other_markup_stays_text() -> None:
    def one(body: str, tools=(TYPED,)) -> tuple[str, list[tuple[str, dict]]]:
        reader = ToolCallReader(list(tools))
        parts = [*reader.feed(OPEN + body + CLOSE), *reader.finish()]
        return "".join(p for p in parts if isinstance(p, str)), [
            (p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)]  # fmt: skip

    param = "<parameter={}>\n{}\n</parameter>\n".format
    body = "\n<function=edit>\n{}</function>\n".format
    # Jinja's string of a boolean, a whole number as a float, a value that is not its type: kept as text
    assert one(body(param("dry_run", "True") + param("line", "3.0") + param("scale", "7") + param("lines", "{}")))[1] \
        == [("edit", {"dry_run": True, "line": 3, "scale": 7, "lines": "{}"})]  # fmt: skip
    assert one(body(param("note", "null") + param("path", "null") + param("extra", "12")))[1] == [
        ("edit", {"note": None, "path": "null", "extra": "12"})]  # fmt: skip
    assert one(body(param("line", "4")), tools=())[1] == [("edit", {"line": "4"})]  # a tool not offered: text
    for broken in ("<function=edit>\ntext<parameter=line>\n4\n</parameter>\n</function>",  # text between
                   "<function=edit>\n<parameter=line>\n4\n</function>",  # a parameter never closed
                   "<function=edit>\n</function>\ntrailing"):  # text after the function
        assert one(broken) == (OPEN + broken + CLOSE, [])


# ------------------------------------------------------------------------------- reasoning
def reasoned(pieces: list[str], thinking: bool = False, tags: tuple[str, str] = (THINK, UNTHINK)) -> tuple[str, str]:
    """The reasoning and the content a reader gives for `pieces` fed in turn."""
    reader = ReasoningReader(thinking, tags)
    parts = [part for piece in pieces for part in reader.feed(piece)] + reader.finish()
    return "".join(p for p in parts if isinstance(p, Reasoning)), "".join(p for p in parts if type(p) is str)


spaces = st.sampled_from(["", " ", "\n", "\n\n", " \n "])
said = st.text(st.sampled_from("ab <>/|[]\nthinkchanelTHINK"), max_size=14)


@st.composite
def thoughts(draw) -> tuple[str, bool, str, str, tuple[str, str]]:
    """An answer, whether its prompt opened its reasoning, its reasoning and content as the module
    docstring of `kvcache.serve.reasoning` defines them, and the tags (Qwen's or Gemma 4's)."""
    think, unthink = tags = draw(st.sampled_from([(THINK, UNTHINK), (CHANNEL, UNCHANNEL),
                                                  (BRACKET_THINK, BRACKET_UNTHINK)]))  # fmt: skip
    opened, closes = draw(st.booleans()), draw(st.booleans())
    thought = draw(said.filter(lambda t: unthink not in t))
    content = draw(said)
    if opened:  # the answer starts thinking; it may end before it closes
        if not closes:
            return draw(spaces) + thought, True, thought.strip(), "", tags
        return draw(spaces) + thought + draw(spaces) + unthink + draw(spaces) + content, True, thought.strip(), \
            content.lstrip(), tags  # fmt: skip
    if draw(st.booleans()):  # it opens a reasoning block itself
        head = draw(spaces) + think + draw(spaces) + thought
        if not closes:
            return head, False, thought.strip(), "", tags
        return head + draw(spaces) + unthink + draw(spaces) + content, False, thought.strip(), content.lstrip(), tags
    text = draw(spaces) + content  # no block: all content, tags and all
    assume(not text.lstrip().startswith(think))
    return text, False, "", text, tags


@settings(max_examples=200, deadline=None)
@given(thoughts(), st.lists(st.integers(0, 60), max_size=6))
def test_the_reasoning_reader_gives_each_answers_reasoning_and_content_for_any_split(answer, cuts) -> None:
    text, thinking, thought, content, tags = answer
    pieces = cut(text, cuts)
    assert reasoned([text], thinking, tags) == (thought, content)
    assert reasoned(pieces, thinking, tags) == (thought, content)
    assert reasoned(list(text), thinking, tags) == (thought, content)


@pytest.mark.parametrize(("template", "fits"), [
    ("{{ messages }}<think>{{ reasoning }}</think>", {"deepseek_r1", "qwen3", "granite", "glm45", "seed_oss",
                                                      "minimax_m2", "ernie45"}),
    ("{{ messages }}[THINK]{{ reasoning }}[/THINK]", {"mistral"}),
    ("{{ messages }}<|channel>thought{{ reasoning }}<channel|>", {"gemma4"}),
    ("{{ messages }}", set()),
])  # fmt: skip
def test_vllms_reasoning_parser_is_taken_where_it_names_the_templates_tags(template, fits) -> None:
    """`--reasoning-parser` (vLLM's, taken so its command lines run): a name is taken where the
    chat template writes its tags, and refused, naming why, where it writes others or none."""
    from types import SimpleNamespace

    from kvcache.serve.reasoning import REASONING_PARSERS, reasoning_parser_refused

    served = SimpleNamespace(kind="transformers", tokenizer=SimpleNamespace(chat_template=template,
                                                                            all_special_tokens=[]))  # fmt: skip
    for name in REASONING_PARSERS:
        refused = reasoning_parser_refused(served, name)
        assert (refused is None) == (name in fits), (name, refused)
        assert refused is None or ("writes its reasoning between" if fits else "writes no reasoning tags") in refused
    assert "not a reasoning format" in reasoning_parser_refused(served, "hunyuan_a13b")


def test_a_prompt_that_leaves_think_open_starts_the_answer_thinking() -> None:
    assert opened_in("<|im_start|>assistant\n<think>\n")
    assert not opened_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not opened_in("<|im_start|>assistant\n")
    assert not opened_in("<|im_start|>user\nwhat does <think> do?<|im_end|>\n<|im_start|>assistant\n")
    assert opened_in("<|turn>model\n<|channel>thought\n", (CHANNEL, UNCHANNEL))
    assert not opened_in("<|turn>model\n<|channel>thought\n<channel|>", (CHANNEL, UNCHANNEL))


# ------------------------------------------------------------------------------- the checks
def chat(**body) -> object:
    return chat_params({"messages": [{"role": "user", "content": "hi"}], **body}, "m", Limits())


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "code": "x"}}]}, "tools[0].function"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather", "x": 1}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": called("Oslo")["tool_calls"]}]}, "messages[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": []}]}, "messages[0].tool_calls"),
])  # fmt: skip
def test_bad_tools_and_tool_turns_are_400s_naming_the_field(body, param) -> None:
    with pytest.raises(ApiError) as caught:
        chat(**body)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]}, "messages[0].reasoning_content"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]}, "messages[0].reasoning_content"),
])  # fmt: skip
def test_bad_template_variables_and_reasoning_turns_are_400s_naming_the_field(body, param) -> None:
    with pytest.raises(ApiError) as caught:
        chat(**body)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_tools_and_tool_turns_are_shaped_as_chat_templates_take_them() -> None:
    assert chat(tools=TOOLS).tools == TOOLS
    turns = [{"role": "user", "content": "w?"}, called("Oslo"), {"role": "tool", "content": "ok", "tool_call_id": "c"}]
    assert chat(tools=TOOLS, messages=turns).messages == template_messages(turns)
    assert chat(tools=TOOLS, tool_choice="none").tools is None  # offered, but not to be called: not written
    assert chat(tools=TOOLS, tool_choice="none").forced_tool is chat(tools=TOOLS).forced_tool is None
    assert chat(tools=TOOLS, tool_choice="required").forced_tool == ""
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(tools=TOOLS, tool_choice=named).forced_tool == "get_weather"
    with pytest.raises(ApiError) as caught:  # a completion has no tools
        completion_params({"prompt": "x", "tools": TOOLS}, "m", Limits())
    assert caught.value.param == "tools"


# ------------------------------------------------------------------------------- served
@pytest.fixture(scope="module", params=["json", "markup", "bare", "gemma", "pythonic", "mistral"])
def tool_server(request, tmp_path_factory):
    """A server of the tool model trained to write tagged JSON calls, markup calls, Llama 3's
    bare JSON calls, Gemma 4's, LFM2's or Mistral's calls (special tokens); and its directory, conversations
    and style."""
    where = tool_model_dir(tmp_path_factory.mktemp("tool-model") / "tool-model", style=request.param)
    process = ServeProcess("--model", str(where), "--threads", "1")
    process.start(tmp_path_factory.mktemp("serve") / "stderr.log")
    yield process, where, conversations(request.param), request.param
    assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory):
    yield from module_server(tmp_path_factory)



def streamed(c, **body) -> tuple[str | None, list[tuple[str, dict]], str]:
    """A streamed chat answer gathered as a client does: its content, its calls, its finish reason."""
    content, calls, finish = None, {}, None
    for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body):
        if not chunk.choices:  # the usage chunk
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for call in delta.tool_calls or []:
            assert (call.id.startswith("call_") or re.fullmatch("[0-9a-z]{9}", call.id)) and call.type == "function"
            calls[call.index] = (call.function.name, json.loads(call.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_a_model_calls_tools_through_the_official_client_whole_and_streamed(tool_server) -> None:
    process, _, taught, style = tool_server
    c = process.client()
    opener = {"gemma": GEMMA_OPEN, "pythonic": PYTHONIC_OPEN, "mistral": "[TOOL_CALLS]"}.get(style, OPEN)
    for messages, tools, answer, cities in taught[:2]:
        # what the trained answer says outside its calls (a bare call is the whole answer)
        text = (answer.split(opener)[0].strip() or None) if opener in answer else None
        expected = [("get_weather", {"city": city}) for city in cities]
        whole = c.chat.completions.create(model="tool-model", messages=messages, tools=tools, temperature=0,
                                          max_tokens=80)  # fmt: skip
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == text
        assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == expected
        assert len({t.id for t in choice.message.tool_calls}) == len(expected)
        assert streamed(c, model="tool-model", messages=messages, tools=tools, temperature=0,
                        max_tokens=80) == (text, expected, "tool_calls")  # fmt: skip


def test_a_tool_result_is_answered_and_the_turns_are_rendered_as_the_template_does(tool_server) -> None:
    from transformers import AutoTokenizer

    process, where, taught, _ = tool_server
    c = process.client()
    tokenizer = AutoTokenizer.from_pretrained(where)
    for messages, tools, answer, _ in taught[2:4]:
        extra = {} if tools is None else {"tools": tools}
        whole = c.chat.completions.create(model="tool-model", messages=messages, temperature=0, max_tokens=40,
                                          **extra)  # fmt: skip
        assert whole.choices[0].message.content == answer and whole.choices[0].finish_reason == "stop"
        assert whole.choices[0].message.tool_calls is None
        prompt = tokenizer.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True,
                                               **extra)  # fmt: skip
        assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    # "none": the tools are neither written into the prompt nor read out of the answer
    messages, tools, _, _ = taught[0]
    plain = c.chat.completions.create(model="tool-model", messages=messages, tools=tools, tool_choice="none",
                                      temperature=0, max_tokens=20)  # fmt: skip
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert plain.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert plain.choices[0].message.tool_calls is None
    assert taught[0][2] != plain.choices[0].message.content


def test_the_calls_a_server_returns_go_back_with_their_results(tool_server) -> None:
    """A client sends the answer's calls back as they came (their ids too) with a result for each:
    the template takes them (Mistral's checks the ids: nine characters), and the prompt is its
    rendering of that conversation."""
    from transformers import AutoTokenizer

    process, where, taught, _ = tool_server
    c = process.client()
    tokenizer = AutoTokenizer.from_pretrained(where)
    messages, tools, _, cities = taught[1]
    message = c.chat.completions.create(model="tool-model", messages=messages, tools=tools, temperature=0,
                                        max_tokens=80).choices[0].message  # fmt: skip
    assert [json.loads(t.function.arguments)["city"] for t in message.tool_calls] == cities
    turns = [*messages, message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
             *({"role": "tool", "content": "rain", "tool_call_id": t.id} for t in message.tool_calls)]  # fmt: skip
    answer = c.chat.completions.create(model="tool-model", messages=turns, tools=tools, temperature=0, max_tokens=4)
    prompt = tokenizer.apply_chat_template(template_messages(turns), tools=tools, tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_a_model_without_a_tool_format_refuses_tools_and_tool_turns(bundled_server) -> None:
    c = bundled_server.client()
    for body in ({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
                 {"messages": [{"role": "user", "content": "w?"}, called("Oslo"),
                               {"role": "tool", "content": "rain", "tool_call_id": "call_1"}]}):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model="kvcache-default", max_tokens=4, **body)
        assert "tool_call" in caught.value.message
    ok = c.chat.completions.create(model="kvcache-default", messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=4, tools=[])  # fmt: skip
    assert ok.choices[0].message.tool_calls is None


def test_a_conversation_the_chat_template_refuses_is_a_400_not_a_500(tmp_path) -> None:
    """A template's `raise_exception` (roles that do not alternate, a system message it has no place
    for) is the client's to fix: `CacheInputError` naming why, which the server answers with a 400."""
    from serve_kit import tiny_model_dir
    from transformers import AutoTokenizer

    from kvcache.errors import CacheInputError
    from kvcache.models.text_model import TextModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir(tmp_path / "tiny"))
    tokenizer.chat_template = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}"
                               "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")  # fmt: skip
    served = TextModel(None, "tiny", [], tokenizer, "transformers")
    assert served.chat_prompt([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(CacheInputError, match="no system role"):
        served.chat_prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])


#: The styles whose tiny models think, and their reasoning's tags
THINKERS = {"markup": (THINK, UNTHINK), "gemma": (CHANNEL, UNCHANNEL), "mistral": (BRACKET_THINK, BRACKET_UNTHINK)}


def test_a_thinking_model_answers_with_its_reasoning_apart_whole_and_streamed(tool_server) -> None:
    """The markup model thinks as Qwen 3.5 does (`<think>`), the Gemma one in Gemma 4's channel
    (special tokens): its reasoning comes back as `reasoning_content`
    and the rest as `content`, whether the prompt opened the reasoning or the model did; an earlier
    turn's reasoning sent back reaches the template (the prompt's tokens are its rendering's), and
    `chat_template_kwargs` are the template's variables."""
    from transformers import AutoTokenizer

    process, where, taught, style = tool_server
    if style not in THINKERS:
        pytest.skip("this model's template does not think")
    think, unthink = THINKERS[style]
    c = process.client()
    tokenizer = AutoTokenizer.from_pretrained(where)
    for messages, _, answer, _ in taught[4:]:
        thought, content = answer.split(unthink)
        expected = (thought.removeprefix(think).strip(), content.strip())
        whole = c.chat.completions.create(model="tool-model", messages=messages, temperature=0, max_tokens=40)
        message = whole.choices[0].message
        assert (message.reasoning_content, message.content) == expected and whole.choices[0].finish_reason == "stop"
        through = tokenizer.encode(thought + unthink, add_special_tokens=False)  # the tokens it was trained to think in
        assert whole.usage.completion_tokens_details.reasoning_tokens == len(through)
        thinking, said = "", ""
        for chunk in c.chat.completions.create(model="tool-model", messages=messages, temperature=0, max_tokens=40,
                                               stream=True):  # fmt: skip
            delta = chunk.choices[0].delta
            thinking += getattr(delta, "reasoning_content", None) or ""
            said += delta.content or ""
        assert (thinking, said) == expected
    turns = [{"role": "user", "content": "Why is the sky blue?"},
             {"role": "assistant", "content": "Blue light scatters most.", "reasoning_content": "Light scatters."},
             {"role": "user", "content": "Say hello."}]  # fmt: skip
    rendered = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert {"markup": "<think>\nLight scatters.\n</think>", "gemma": "<|channel>thought\nLight scatters.<channel|>",
            "mistral": "[THINK]Light scatters.[/THINK]"}[style] in rendered  # fmt: skip
    answer = c.chat.completions.create(model="tool-model", messages=turns, temperature=0, max_tokens=4)
    assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    # a template variable (Qwen's switch): the template closes an empty block, the answer is all content
    quiet = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert quiet.endswith({"markup": "<think>\n\n</think>\n\n", "gemma": "<|channel>thought\n<channel|>",
                           "mistral": "[THINK][/THINK]"}[style])  # fmt: skip
    off = c.chat.completions.create(model="tool-model", messages=turns, temperature=0, max_tokens=4,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert off.usage.prompt_tokens == len(tokenizer.encode(quiet, add_special_tokens=False))


#: How each style's template starts a call, written out here: what a forced `tool_choice` must put
#: at the end of the prompt (a call to any tool, a call to get_weather)
OPENINGS = {
    "json": ('<tool_call>\n{"name":', '<tool_call>\n{"name": "get_weather", "arguments":'),
    "markup": ("<tool_call>\n<function=", "<tool_call>\n<function=get_weather>\n"),
    "bare": ('{"name":', '{"name": "get_weather", "parameters":'),
    "gemma": ("<|tool_call>call:", "<|tool_call>call:get_weather{"),
    "pythonic": ("<|tool_call_start|>[", "<|tool_call_start|>[get_weather("),
    "mistral": ("[TOOL_CALLS]", "[TOOL_CALLS]get_weather[ARGS]"),
}


def test_a_forced_tool_choice_starts_the_answer_with_the_call(tool_server) -> None:
    """`tool_choice` "required" or a named function: the prompt is the template's rendering and the
    start of a call as the template writes one (its tokens count as the prompt's), the model goes
    on from there, and the call comes back as `tool_calls`, whole, streamed and through the
    Responses API. In every format the rest is held to the tool's schema: one call whose arguments
    follow the schema, whatever the model would write (the tiny model was never taught to call for
    a greeting); a call cut by `max_tokens` is content, the forced start included. A thinking
    model's forced answer skips its reasoning (an empty block, closed in the prompt)."""
    from transformers import AutoTokenizer

    process, where, taught, style = tool_server
    c = process.client()
    tokenizer = AutoTokenizer.from_pretrained(where)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for messages, _, _, _ in taught[:4]:
        rendered = tokenizer.apply_chat_template(template_messages(messages), tools=TOOLS, tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
        for choice, opening in zip(("required", named), OPENINGS[style], strict=True):
            whole = c.chat.completions.create(model="tool-model", messages=messages, tools=TOOLS, temperature=0,
                                              tool_choice=choice, max_tokens=60)  # fmt: skip
            assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered + opening, add_special_tokens=False))
            message, finish = whole.choices[0].message, whole.choices[0].finish_reason
            if message.tool_calls is None:  # the model did not complete a call: what it wrote is content
                assert message.content.startswith(opening) and finish != "tool_calls"
                assert finish == "length"  # (a held call ends only with its end)
            else:
                assert finish == "tool_calls" and message.content is None
                assert all(t.function.name == "get_weather" for t in message.tool_calls)
                (call,) = message.tool_calls  # held to the schema: one call, a string city
                assert isinstance(json.loads(call.function.arguments)["city"], str)
    # the model was taught these two calls: forced, it writes the first from the forced start on
    # (held to its schema, the answer ends with it)
    messages, expected = taught[1][0], [("get_weather", {"city": "Rome"})]
    for choice in ("required", named):
        body = {"model": "tool-model", "messages": messages, "tools": TOOLS, "tool_choice": choice, "temperature": 0,
                "max_tokens": 80}  # fmt: skip
        message = c.chat.completions.create(**body).choices[0].message
        assert message.tool_calls is not None, (message.content, choice)
        assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == expected
        assert message.content is None
        assert streamed(c, **body) == (None, expected, "tool_calls")
    # a stop string that cuts the held call: the text up to it, without the closing tag a call
    # the grammar ended would get (the call is not complete)
    from kvcache.serve.api import HELD_CLOSINGS

    cut = c.chat.completions.create(model="tool-model", messages=messages, tools=TOOLS, tool_choice=named,
                                    temperature=0, max_tokens=80, stop=["Rome"])  # fmt: skip
    message, finish = cut.choices[0].message, cut.choices[0].finish_reason
    assert message.tool_calls is None and finish == "stop" and message.content.startswith(OPENINGS[style][1])
    assert "Rome" not in message.content and not message.content.endswith(HELD_CLOSINGS.get(style) or "\0")
    flat = [{"type": "function", **tool["function"]} for tool in TOOLS]
    answer = c.responses.create(model="tool-model", input=messages, tools=flat, temperature=0, max_output_tokens=80,
                                tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert [(i.name, json.loads(i.arguments)) for i in answer.output if i.type == "function_call"] == expected
    if style in THINKERS:  # a prompt that opens its reasoning: the forced answer closes it empty first
        messages = taught[4][0]
        rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert opened_in(rendered, THINKERS[style])
        whole = c.chat.completions.create(model="tool-model", messages=messages, tools=TOOLS, temperature=0,
                                          tool_choice=named, max_tokens=30)  # fmt: skip
        prompt = rendered + closing(THINKERS[style]) + OPENINGS[style][1]
        assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
        assert getattr(whole.choices[0].message, "reasoning_content", None) is None
        details = whole.usage.completion_tokens_details
        assert details is None or details.reasoning_tokens == 0
