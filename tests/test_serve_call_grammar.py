"""A forced tool call's grammar (`tool_choice` "required" or a named function), in every call
format the server reads: after the opening the prompt ends with, the call a family's template
writes is allowed token by token to its end and reads back as that one call, and what breaks
the tool's schema is masked; any `parameters` object gives a grammar or none. The calls are
checked through llguidance's matcher over tokenizers built here (`tool_model`), whose tags are
tokens of their own where a family's are; served tiny models of every format are in
`test_serve_tools.py`."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")

from tool_model import (
    GEMMA_TAGS,
    GEMMA_TEMPLATE,
    MARKUP_TEMPLATE,
    MISTRAL_TAGS,
    MISTRAL_TEMPLATE,
    PYTHONIC_TAGS,
    PYTHONIC_TEMPLATE,
    WEATHER,
    nested,
    read_styled,
    styled_tokenizer,
)

from kvcache.serve.gemma_calls import OPEN as GEMMA_OPEN
from kvcache.serve.gemma_calls import QUOTE
from kvcache.serve.grammar import call_grammar
from kvcache.serve.pythonic_calls import OPEN as PYTHONIC_OPEN
from kvcache.serve.tools import call_opening


def allowed_run(tokenizer, matcher_tokenizer, grammar: str, rest: str) -> tuple[int, int, bool]:
    """How many tokens of `rest` a `Constraint` of `grammar` allows in a row, of how many, and
    whether it is done after all of them."""
    from kvcache.serve.grammar import Constraint

    constraint = Constraint(matcher_tokenizer, grammar, len(tokenizer))
    tokens = tokenizer.encode(rest, add_special_tokens=False)
    for i, token in enumerate(tokens):
        if constraint.done or not constraint.allowed[token]:
            return i, len(tokens), False
        constraint.accept(token)
    return len(tokens), len(tokens), constraint.done


#: A second tool, so that a call to a tool the model picks has a choice to make
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"]}}}  # fmt: skip


@pytest.mark.parametrize("style", ["mistral", "mistral-args"])
def test_a_forced_mistral_call_is_held_to_its_tools_schema(style) -> None:
    """Mistral's calls carry JSON arguments, so a forced one is held to the tool's schema as a
    tagged JSON call is: after the opening the prompt ends with, each token of the call as the
    template writes it is allowed in turn (`[ARGS]` as the control token it is, where the model
    picks the tool) and the answer ends with the call's end, which reads back as that one call
    (v3's with or without the id its templates write after the arguments); arguments off the
    schema, a tool not offered, or an id of another length, are masked on the way."""
    llguidance_hf = pytest.importorskip("llguidance.hf")
    tokenizer = styled_tokenizer(MISTRAL_TAGS, MISTRAL_TEMPLATE)
    args_token = tokenizer.convert_tokens_to_ids("[ARGS]")
    matcher_tokenizer = llguidance_hf.from_tokenizer(tokenizer, eos_token=tokenizer.convert_tokens_to_ids("</s>"))

    def written(name: str, arguments: str, call_id: str = "") -> str:
        if style == "mistral":
            named = '[TOOL_CALLS] [{"name": "' + name + '", "arguments": ' + arguments
            return named + (f', "id": "{call_id}"' if call_id else "") + "}]"
        return f"[TOOL_CALLS]{name}[ARGS]{arguments}"

    def walk(name: str, rest: str) -> tuple[int, bool]:
        """How many tokens of `rest` the grammar allows in a row, and whether it is done after."""
        grammar = call_grammar(style, [WEATHER, ALARM], name, {"[ARGS]": args_token}.get)
        held, _, done = allowed_run(tokenizer, matcher_tokenizer, grammar, rest)
        return held, done

    for forced, call_id in itertools.product(("set_alarm", ""), ("", "a1b2c3d4e")):
        opening = call_opening(style, forced)
        text = written("set_alarm", '{"hour": 7}', call_id)
        assert text.startswith(opening)
        rest = text[len(opening):]
        assert walk(forced, rest) == (len(tokenizer.encode(rest, add_special_tokens=False)), True)
        assert read_styled(text, style) == ("", [("set_alarm", {"hour": 7})])
        for off in (written("set_alarm", '{"hour": "7"}'), written("set_alarm", '{"minute": 7}'),
                    written("set_timer", '{"hour": 7}')) + ((written("set_alarm", '{"hour": 7}', "a1b2"),)
                                                            if style == "mistral" else ()):  # fmt: skip
            if off.startswith(opening):
                rest = off[len(opening):]
                assert walk(forced, rest)[0] < len(tokenizer.encode(rest, add_special_tokens=False)), off
    assert call_grammar(style, [WEATHER], "") is None or style == "mistral"  # no [ARGS] token: the model's


FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "units": {"enum": ["c", "f"]}, "days": {"type": "integer"},
    "hours": {"type": "array", "items": {"type": "number"}}, "alerts": {"type": ["boolean", "null"]}},
    "required": ["city"]}}}  # fmt: skip
bmp_text = st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)), max_size=8)


#: The markup's tags, which a tokenizer may hold as tokens of their own (as `tool_model`'s does)
MARKUP_TAGS = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")


@pytest.fixture(scope="module")
def keyword_styles():
    """By style: the tokenizer, llguidance's view of it, and its `token_id` (the tags it holds as
    tokens: Gemma's quote; the markup's, for "markup+tags", written in text for "markup")."""
    llguidance_hf = pytest.importorskip("llguidance.hf")
    transformers = pytest.importorskip("transformers")
    from serve_kit import byte_level_bpe
    from tokenizers import AddedToken

    bpe = byte_level_bpe(["ab"], 270, ["<unk>"])
    bpe.add_tokens([AddedToken(t, special=False) for t in MARKUP_TAGS])
    tagged = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")
    out = {}
    pythonic, gemma = styled_tokenizer(PYTHONIC_TAGS, PYTHONIC_TEMPLATE), styled_tokenizer(GEMMA_TAGS, GEMMA_TEMPLATE)
    for style, tokenizer, end, tags in (("pythonic", pythonic, "<|im_end|>", ()), ("gemma", gemma, "<turn|>", (QUOTE,)),
                                        ("markup", styled_tokenizer((), MARKUP_TEMPLATE), "<unk>", ()),
                                        ("markup+tags", tagged, "<unk>", MARKUP_TAGS)):  # fmt: skip
        matcher = llguidance_hf.from_tokenizer(tokenizer, eos_token=tokenizer.convert_tokens_to_ids(end))
        out[style] = (tokenizer, matcher, {tag: tokenizer.convert_tokens_to_ids(tag) for tag in tags}.get)
    return out


def keyword_call(style: str, name: str, arguments: dict, python_strings: bool = True) -> str:
    """A call as LFM2 (`pythonic`), Gemma 4 or Qwen 3.5 (`markup`) writes it, the arguments in
    the order given (to its end: without the closing tag the server adds); LFM2's strings as
    Python writes them (`repr`, single quotes mostly, as LFM2.5's template does) or in double
    quotes (`python_strings` False, as LFM2's model card shows), its other values as Python's
    `str` writes them; the markup's numbers, booleans and nulls as Python's `str` writes them (as
    Qwen's templates do with Jinja's `string`) or as JSON (`python_strings` False); Gemma's null
    as its template writes it (`None`) or as JSON."""
    if style == "markup":  # (numbers, booleans and nulls as Jinja's `string` writes them, or as JSON)
        written = str if python_strings else json.dumps
        shown = [f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v) if isinstance(v, list) else written(v)}"
                 "\n</parameter>\n" for k, v in arguments.items()]  # fmt: skip
        return f"<tool_call>\n<function={name}>\n{''.join(shown)}</function>"
    if style == "pythonic":
        shown = [f"{k}={(repr(v) if python_strings else json.dumps(v)) if isinstance(v, str) else str(v)}"
                 for k, v in arguments.items()]  # fmt: skip
        return f"{PYTHONIC_OPEN}[{name}({', '.join(shown)})]"

    def gemma(v: object) -> str:
        if isinstance(v, str):
            return QUOTE + v + QUOTE
        if isinstance(v, list):
            return "[" + ",".join(gemma(x) for x in v) + "]"
        return "None" if v is None and python_strings else json.dumps(v)  # (Gemma 4's template writes None)

    return f"{GEMMA_OPEN}call:{name}{{" + ",".join(f"{k}:{gemma(v)}" for k, v in arguments.items()) + "}"


@settings(max_examples=80, deadline=None)
@given(city=bmp_text.filter(lambda t: QUOTE not in t and "</parameter>" not in t),
       units=st.sampled_from([None, "c", "f"]), days=st.none() | st.integers(-(10**9), 10**9),
       hours=st.none() | st.lists(st.floats(-1e6, 1e6) | st.integers(-99, 99), max_size=3),
       alerts=st.sampled_from(["absent", True, False, None]), forced=st.sampled_from(["forecast", ""]),
       styled=st.sampled_from(["pythonic", "gemma", "markup", "markup+tags"]),
       python_strings=st.booleans())  # fmt: skip
def test_a_forced_call_in_keyword_syntax_is_held_to_its_tools_schema(keyword_styles, city, units, days, hours,
                                                                     alerts, forced, styled,
                                                                     python_strings) -> None:  # fmt: skip
    """LFM2's calls are Python (`NAME(key=value, ...)`), Gemma 4's `NAME{key:value,...}` and Qwen
    3.5's markup one `<parameter=KEY>` block per argument, so a forced one is held by a grammar
    written from the tool's schema (`keyword_grammar`): after the opening the prompt ends with, a
    call whose arguments follow the schema (in its order, sorted for Gemma as its template sorts
    them; the required one always, any optional one at most once), written as the family writes
    values (Gemma's strings between its quote token; the markup's strings as they are, its tags
    tokens of their own or text), is allowed token by token to its end, where the answer ends, and
    reads back (with the closing tag the server adds) as that call; a call that breaks the schema
    (a value of another type, a key it lacks, the required one missing, keys out of order, a tool
    not offered) is masked on the way."""
    from kvcache.serve.api import HELD_CLOSINGS
    tokenizer, matcher, token_id = keyword_styles[styled]
    style = styled.removesuffix("+tags")
    arguments = {"alerts": alerts, "city": city, "days": days, "hours": hours, "units": units}
    if style != "gemma":  # (the schema's order)
        arguments = {k: arguments[k] for k in FORECAST["function"]["parameters"]["properties"]}
    kept = [k for k, v in arguments.items() if v != "absent" and (v is not None or k == "alerts")]
    arguments = {k: arguments[k] for k in kept}
    grammar = call_grammar(style, [WEATHER, FORECAST], forced, token_id)
    opening = call_opening(style, forced)
    text = keyword_call(style, "forecast", arguments, python_strings)
    assert text.startswith(opening)
    held, total, done = allowed_run(tokenizer, matcher, grammar, text[len(opening):])
    assert (held, done) == (total, True), text
    assert read_styled(text + HELD_CLOSINGS[style], style, [FORECAST]) == ("", [("forecast", arguments)])
    broken = [{**arguments, "days": "three"}, {**arguments, "town": "x"},
              {k: v for k, v in arguments.items() if k != "city"},
              dict(reversed(arguments.items())) if len(arguments) > 1 else {**arguments, "city": 3}]  # fmt: skip
    if style == "markup" and len(arguments) == 1:
        broken.pop()  # (the markup writes a string as it is: 3 is the string "3")
    for other in [keyword_call(style, "forecast", b) for b in broken] + [keyword_call(style, "set_alarm", arguments)]:
        if other.startswith(opening):
            held, total, done = allowed_run(tokenizer, matcher, grammar, other[len(opening):])
            assert held < total or not done, other


schema_words = st.sampled_from(["type", "properties", "required", "enum", "const", "items", "anyOf", "city", "a b"])
schema_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(
    ["string", "integer", "number", "boolean", "null", "object", "array", "city", "x'y", "<p>"]))  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(parameters=st.dictionaries(schema_words, st.recursive(schema_leaf, nested(schema_words), max_leaves=10),
                                  max_size=4),
       style=st.sampled_from(["json", "bare", "mistral", "mistral-args", "pythonic", "gemma", "markup"]),
       forced=st.sampled_from(["", "f"]))  # fmt: skip
@example(parameters={"properties": {"a": {}}, "required": [["a"]]}, style="pythonic", forced="f")
@example(parameters={"properties": {"a": {}}, "required": "a"}, style="markup", forced="")
def test_a_forced_calls_grammar_is_built_or_left_out_for_any_parameters_schema(parameters, style, forced) -> None:
    """A client's `parameters` may be any JSON object: the grammar of a forced call to such a tool is
    built (and llguidance can follow it) or left out (the call is the model's own), in every
    format, never an error (which would be a 500)."""
    llguidance = pytest.importorskip("llguidance")
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}, FORECAST]
    grammar = call_grammar(style, tools, forced, {"[ARGS]": 7, QUOTE: 8, "</parameter>": 9}.get)
    assert grammar is None or llguidance.LLMatcher.validate_grammar(grammar) == ""


def test_a_tool_whose_name_is_not_a_python_name_is_left_to_the_model_in_lfm2_calls(keyword_styles) -> None:
    """`my-tool(...)` is not Python, so LFM2's reader could not read a call to such a tool: a call
    forced to it is the model's own (no grammar), and one to a tool the model picks may name only
    the others. Gemma's syntax writes such a name (`call:my-tool{...}`)."""
    tokenizer, matcher, token_id = keyword_styles["pythonic"]
    dashed = {"type": "function", "function": {"name": "my-tool", "parameters": {"type": "object"}}}
    assert call_grammar("pythonic", [dashed, FORECAST], "my-tool", token_id) is None
    assert call_grammar("pythonic", [dashed], "", token_id) is None
    grammar = call_grammar("pythonic", [dashed, FORECAST], "", token_id)
    for name, allowed in (("forecast", True), ("my-tool", False)):
        rest = keyword_call("pythonic", name, {"city": "x"})[len(call_opening("pythonic", "")) :]
        held, total, done = allowed_run(tokenizer, matcher, grammar, rest)
        assert (held == total and done) == allowed, name
    assert call_grammar("gemma", [dashed], "my-tool", keyword_styles["gemma"][2]) is not None
