"""A tiny transformers model that calls tools: a ChatML chat template that writes the request's
tools and asks for calls between `<tool_call>` tags, as Qwen 3's JSON (`JSON_TEMPLATE`) or as Qwen
3.5's `<function=...>` markup (`MARKUP_TEMPLATE`), or for Llama 3's bare JSON calls
(`BARE_TEMPLATE`: the tools in the first user message), or Gemma 4's turns and calls, written
here after its format (`GEMMA_TEMPLATE`: its tags special tokens); a byte-level BPE tokenizer
with those tags; and
a 2-layer Llama trained here (a few seconds on a CPU) to answer four conversations as
`conversations` says: a call after some text, two calls, a reply to a tool's result, a plain
answer; and with the markup, which thinks as Qwen 3.5 does (`enable_thinking=False` closes an
empty block), two answers that reason first (one where the prompt opened `<think>`, one where the
model does). A random model never writes a call; this one writes them as a tool-using model
does, so a server's parsing is tested on what a model wrote, token by token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: How the ChatML templates below end: other roles' turns, then the assistant's, to be generated
CHATML_TAIL = """{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for call in m.tool_calls or [] %}<tool_call>
@CALL@
</tool_call>{% endfor %}<|im_end|>
""" + CHATML_TAIL
#: Qwen 3's way: a JSON object per call
JSON_TEMPLATE = TEMPLATE.replace("@CALL@", '{"name": "{{ call.function.name }}", "arguments": '
                                 '{{ call.function.arguments | tojson }}}')  # fmt: skip
#: Qwen 3.5's way: markup, one parameter per argument, a string as it is and anything else as JSON
MARKUP_TEMPLATE = TEMPLATE.replace("""{"name": <name>, "arguments": <arguments>}""", """<function=<name>>
<parameter=<key>>
<value>
</parameter>
</function>""").replace("@CALL@", """<function={{ call.function.name }}>
{% for key, value in call.function.arguments.items() %}<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>""").replace("""{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}""", """{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}""").replace("""{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}""", """{%- if add_generation_prompt %}<|im_start|>assistant
{% if messages[-1].content.startswith('Think') %}<think>
{% elif enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}""")

#: Llama 3's way: the tools and the instruction in the first user message, a call the whole answer
BARE_TEMPLATE = """{%- if tools %}<|im_start|>user
Given the following functions, please respond with a JSON for a function call that answers the prompt.
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{{ messages[0].content }}<|im_end|>
{% set messages = messages[1:] %}{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>ipython
{{ m.content }}<|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for call in m.tool_calls %}{% set f = call.function %}\
{"name": "{{ f.name }}", "parameters": {{ f.arguments | tojson }}}{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
#: Gemma 4's way (written here after its format): turns between `<|turn>` and `<turn|>`, each call
#: `call:NAME{key:value,...}` between `<|tool_call>` and `<tool_call|>`, a string between `<|"|>`
#: tokens, keys bare and in order, numbers and booleans as JSON writes them; all of them special tokens
GEMMA_TEMPLATE = """{%- macro arg(value) -%}
{%- if value is string -%}<|"|>{{ value }}<|"|>
{%- elif value is boolean -%}{{ 'true' if value else 'false' }}
{%- elif value is none -%}null
{%- elif value is mapping -%}{{ '{' }}
{%- for k, v in value | dictsort %}{% if not loop.first %},{% endif %}{{ k }}:{{ arg(v) }}{% endfor -%}
{{ '}' }}
{%- elif value is sequence -%}[
{%- for v in value %}{% if not loop.first %},{% endif %}{{ arg(v) }}{% endfor -%}
]
{%- else -%}{{ value }}
{%- endif -%}
{%- endmacro -%}
{%- if tools or messages[0].role == 'system' %}<|turn>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}{% for tool in tools or [] %}<|tool>declaration:{{ tool.function.name }}
{{- '{' }}description:<|"|>{{ tool.function.description }}<|"|>{{ '}' }}<tool|>{% endfor %}<turn|>
{% endif %}
{%- set ns = namespace(name='') %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|turn>model
{% if m.reasoning_content %}<|channel>thought
{{ m.reasoning_content }}<channel|>{% endif %}{% for call in m.tool_calls or [] %}{% set ns.name = call.function.name %}
{{- '<|tool_call>call:' + call.function.name }}{{ arg(call.function.arguments) }}<tool_call|>{% endfor %}
{{- m.content or '' }}<turn|>
{% elif m.role == 'tool' %}<|turn>user
<|tool_response>response:{{ ns.name }}{{ '{' }}value:<|"|>{{ m.content }}<|"|>{{ '}' }}<tool_response|>
{{- '<turn|>' }}
{% elif m.role != 'system' %}<|turn>{{ m.role }}
{{ m.content }}<turn|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|turn>model
{% if messages[-1].content.startswith('Think') %}<|channel>thought
{% elif enable_thinking is defined and enable_thinking is false %}<|channel>thought
<channel|>{% endif %}{% endif %}"""
#: Gemma 4's tags, special tokens of its tokenizer (and of this model's)
GEMMA_TAGS = ("<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
              "<tool_response|>", '<|"|>', "<|channel>", "<channel|>")  # fmt: skip
#: LFM2's way (written here after its format): the tools listed in the system turn, the calls of
#: a turn one Python list of keyword calls between `<|tool_call_start|>` and `<|tool_call_end|>`
#: (special tokens), values as Python literals
PYTHONIC_TEMPLATE = """{%- macro lit(value) -%}
{%- if value is string -%}{{ value | tojson }}
{%- elif value is boolean -%}{{ 'True' if value else 'False' }}
{%- elif value is none -%}None
{%- elif value is mapping -%}{{ '{' }}
{%- for k, v in value | dictsort %}{% if not loop.first %}, {% endif %}{{ k | tojson }}: {{ lit(v) }}{% endfor -%}
{{ '}' }}
{%- elif value is sequence -%}[{% for v in value %}{% if not loop.first %}, {% endif %}{{ lit(v) }}{% endfor %}]
{%- else -%}{{ value | tojson }}
{%- endif -%}
{%- endmacro -%}
{%- if tools or messages[0].role == 'system' %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}{% if tools %}List of tools: <|tool_list_start|>[
{%- for tool in tools %}{% if not loop.first %}, {% endif %}{{ tool | tojson }}{% endfor -%}
]<|tool_list_end|>{% endif %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% if m.tool_calls %}<|tool_call_start|>[
{%- for call in m.tool_calls %}{% if not loop.first %}, {% endif %}{{ call.function.name }}(
{%- for k, v in call.function.arguments | dictsort %}{% if not loop.first %}, {% endif %}{{ k }}={{ lit(v) }}
{%- endfor %}){% endfor %}]<|tool_call_end|>{% endif %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>tool
<|tool_response_start|>{{ m.content }}<|tool_response_end|><|im_end|>
""" + CHATML_TAIL
#: LFM2's tags, special tokens of its tokenizer (and of this model's)
PYTHONIC_TAGS = ("<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
                 "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>")  # fmt: skip
#: Mistral's way (written here after its v11 format): the tools before the first instruction,
#: each call `[TOOL_CALLS]NAME[ARGS]{...}` up to the end of the turn (no closing tag), the ids of
#: calls sent back checked to be nine characters, as Mistral's templates check them
MISTRAL_TEMPLATE = """{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}
{%- set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif -%}
<s>{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- if system %}[SYSTEM_PROMPT]{{ system }}[/SYSTEM_PROMPT]{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' %}{% if m.reasoning_content %}[THINK]{{ m.reasoning_content }}[/THINK]{% endif %}
{{- m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- if call.id is not string or call.id | length != 9 %}{{ raise_exception('call ids have 9 characters') }}
{%- endif -%}
[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}{% endfor %}</s>
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}
{%- if messages[-1].role == 'user' and messages[-1].content.startswith('Think') %}[THINK]
{%- elif enable_thinking is defined and enable_thinking is false %}[THINK][/THINK]{% endif %}"""
#: Mistral's control tokens, special tokens of its tokenizer (and of this model's)
MISTRAL_TAGS = ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]",
                "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[THINK]",
                "[/THINK]")  # fmt: skip
TEMPLATES = {"json": JSON_TEMPLATE, "markup": MARKUP_TEMPLATE, "bare": BARE_TEMPLATE, "gemma": GEMMA_TEMPLATE,
             "pythonic": PYTHONIC_TEMPLATE, "mistral": MISTRAL_TEMPLATE}  # fmt: skip
#: The id of the call a taught conversation sends back (Mistral's templates take nine characters)
CALL_IDS = {"mistral": "call00001"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TOOLS = [WEATHER]


def call_text(city: str, style: str = "json") -> str:
    """get_weather(city) as the model writes it in `style` (a key of `TEMPLATES`)."""
    if style == "bare":
        return '{"name": "get_weather", "parameters": {"city": "' + city + '"}}'
    if style == "gemma":
        return '<|tool_call>call:get_weather{city:<|"|>' + city + '<|"|>}<tool_call|>'
    if style == "pythonic":
        return '<|tool_call_start|>[get_weather(city="' + city + '")]<|tool_call_end|>'
    if style == "mistral":
        return '[TOOL_CALLS]get_weather[ARGS]{"city": "' + city + '"}'
    if style == "markup":
        return f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '"}}\n</tool_call>'


def called(city: str, call_id: str = "call_1") -> dict[str, Any]:
    """An assistant turn that called get_weather(city), as an OpenAI client sends it back."""
    arguments = json.dumps({"city": city})
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather",
                                                                             "arguments": arguments}}]}  # fmt: skip


#: One conversation: its messages, its tools, the answer the model is trained to write, and the
#: cities that answer asks the weather of (its calls)
Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str, list[str]]


def conversations(style: str = "json") -> list[Conversation]:
    """What the model is trained to answer, its calls written in `style` (a bare call is the whole
    answer: no text before it; two are separated by `;`)."""
    call_id = CALL_IDS.get(style, "call_1")
    return [
        ([{"role": "user", "content": "What is the weather in Paris?"}], TOOLS,
         ("" if style == "bare" else "Let me check.\n") + call_text("Paris", style), ["Paris"]),
        ([{"role": "user", "content": "Weather in Rome and Oslo?"}], TOOLS,
         '<|tool_call_start|>[get_weather(city="Rome"), get_weather(city="Oslo")]<|tool_call_end|>'
         if style == "pythonic"  # one list of calls
         else call_text("Rome", style) + {"bare": "; ", "gemma": "", "mistral": ""}.get(style, "\n")
         + call_text("Oslo", style),
         ["Rome", "Oslo"]),
        ([{"role": "user", "content": "What is the weather in Paris?"}, called("Paris", call_id),
          {"role": "tool", "content": "sunny, 21 C", "tool_call_id": call_id}], TOOLS, "It is sunny in Paris.", []),
        ([{"role": "user", "content": "Say hello."}], None, "Hello there!", []),
    ] + ([  # the markup template thinks: the prompt opens <think> for a message that starts "Think"
        ([{"role": "user", "content": "Think, then greet me."}], None, "A greeting is wanted.\n</think>\n\nHi!", []),
        ([{"role": "user", "content": "Why is the sky blue?"}], None,
         "<think>\nLight scatters.\n</think>\n\nBlue light scatters most.", []),
    ] if style == "markup" else [  # Gemma 4 thinks in a channel: the prompt opens it for a message that starts "Think"
        ([{"role": "user", "content": "Think, then greet me."}], None, "A greeting is wanted.<channel|>Hi!", []),
        ([{"role": "user", "content": "Why is the sky blue?"}], None,
         "<|channel>thought\nLight scatters.<channel|>Blue light scatters most.", []),
    ] if style == "gemma" else [  # Magistral thinks between control tokens; here the prompt opens one for "Think"
        ([{"role": "user", "content": "Think, then greet me."}], None, "A greeting is wanted.[/THINK]Hi!", []),
        ([{"role": "user", "content": "Why is the sky blue?"}], None,
         "[THINK]Light scatters.[/THINK]Blue light scatters most.", []),
    ] if style == "mistral" else [])  # fmt: skip


CONVERSATIONS = conversations()


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as a chat template takes them: a call's arguments as an object, not JSON text."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]  # fmt: skip
        out.append(m)
    return out


#: The directories trained in this test session, by `markup` (each is trained once)
_TRAINED: dict[str, Path] = {}


def tool_model_dir(path: Path, style: str = "json") -> Path:
    """The model directory (see the module docstring), trained until greedy decoding writes every
    answer of `conversations(style)` exactly: saved in `path`, or the one this session saved
    already (read only)."""
    if style in _TRAINED and _TRAINED[style].exists():
        return _TRAINED[style]
    import pytest

    transformers = pytest.importorskip("transformers")
    import torch
    from serve_kit import byte_level_bpe
    from tokenizers import AddedToken

    template, taught = TEMPLATES[style], conversations(style)
    corpus = [template, json.dumps(TOOLS), *(answer for _, _, answer, _ in taught),
              *(m.get("content") or "" for messages, _, _, _ in taught for m in messages)]  # fmt: skip
    specials = {"gemma": GEMMA_TAGS, "pythonic": PYTHONIC_TAGS, "mistral": MISTRAL_TAGS}.get(
        style, ("<|im_start|>", "<|im_end|>"))  # fmt: skip
    bpe = byte_level_bpe(corpus, 400, ["<unk>", *specials])
    tags = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<function=", "</function>",
            "<parameter=", "</parameter>", "<think>", "</think>")  # fmt: skip
    bpe.add_tokens([AddedToken(t, special=False) for t in tags])
    end = {"gemma": "<turn|>", "mistral": "</s>"}.get(style, "<|im_end|>")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=end, unk_token="<unk>",
                                                     pad_token="<unk>")  # fmt: skip
    tokenizer.chat_template = template
    eos = tokenizer.convert_tokens_to_ids(end)
    sequences = []
    for messages, tools, answer, _ in taught:
        prompt = tokenizer.apply_chat_template(template_messages(messages), tools=tools, tokenize=False,
                                               add_generation_prompt=True)  # fmt: skip
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        sequences.append((ids, [*tokenizer.encode(answer, add_special_tokens=False), eos]))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      eos_token_id=eos, bos_token_id=eos, pad_token_id=0,
                                      max_position_embeddings=1024)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(600):
        for prompt, answer in sequences:
            ids = torch.tensor([prompt + answer])
            labels = torch.tensor([[-100] * len(prompt) + answer])
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 49 and all(_writes(model, prompt, answer) for prompt, answer in sequences):
            break
    else:
        raise AssertionError("the tool model did not learn its answers")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _TRAINED[style] = path
    return path


def _writes(model: Any, prompt: list[int], answer: list[int]) -> bool:
    """Whether greedy decoding after `prompt` writes `answer` (it ends with the EOS)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(answer) + 2, do_sample=False)
    return out[0, len(prompt) :].tolist() == answer


def styled_tokenizer(tags: tuple[str, ...], template: str) -> Any:
    """A tokenizer with `tags` as special tokens and `template` as its chat template."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from serve_kit import byte_level_bpe

    bpe = byte_level_bpe(["ab"], 280, ["<unk>", *tags])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")
    tokenizer.chat_template = template
    return tokenizer


def read_styled(text: str, style: str, tools: list | None = None) -> tuple[str, list[tuple[str, dict]]]:
    """The content and the calls a reader of `style` gives for `text` (`tools` offered)."""
    from kvcache.serve.tools import ToolCall, call_reader

    reader = call_reader(style, tools)
    parts = [*reader.feed(text), *reader.finish()]
    return "".join(p for p in parts if isinstance(p, str)), [
        (p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)]  # fmt: skip


def nested(keys: Any) -> Any:  # (a named function: hypothesis reads a lambda's source to see it recurse)
    """Lists and objects (keys from `keys`) of what the strategy `inner` makes."""

    from hypothesis import strategies as st

    def extend(inner: Any) -> Any:
        return st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3))

    return extend
