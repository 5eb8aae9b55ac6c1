"""OpenAI's Responses API on `kvcache serve` (`POST /v1/responses`), through the official client:
what a response says equals what the chat completions endpoint answers to the same conversation
(the reference: its answers are checked against `generate` elsewhere), whole and streamed (the
client's own stream helper rebuilds the response from the events, which it checks in order);
function calls and their outputs as input items, read by a model trained to answer them
(`tool_model`); a thinking model's reasoning as a reasoning item; bad requests as 400s naming the
Responses field."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_kit import ServeProcess, module_server  # noqa: E402
from tool_model import TOOLS, WEATHER, conversations, template_messages, tool_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FLAT = [{"type": "function", **WEATHER["function"]}]  # the Responses API's shape of the tools


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory):
    yield from module_server(tmp_path_factory)


@pytest.fixture(scope="module")
def markup_server(tmp_path_factory):
    """The tool model that writes Qwen 3.5's markup and thinks, and its directory."""
    where = tool_model_dir(tmp_path_factory.mktemp("tool-model") / "tool-model", style="markup")
    process = ServeProcess("--model", str(where), "--threads", "1")
    process.start(tmp_path_factory.mktemp("serve") / "stderr.log")
    yield process, where
    assert process.terminate() == 0, process.log()



def test_a_response_says_what_the_chat_endpoint_answers_whole_and_streamed(bundled_server) -> None:
    c = bundled_server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The cache holds"}]
    chat = c.chat.completions.create(model="kvcache-default", messages=messages, temperature=0, max_tokens=12)
    given = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "The cache holds"}]}]
    for request in ({"input": given, "instructions": "Be brief."}, {"input": messages}):
        whole = c.responses.create(model="kvcache-default", temperature=0, max_output_tokens=12, **request)
        assert whole.output_text == chat.choices[0].message.content
        assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
        assert [item.type for item in whole.output] == ["message"]
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
        assert whole.usage.total_tokens == chat.usage.total_tokens
        # cut by max_output_tokens, a stream ends with `response.incomplete` (the client's stream helper
        # waits for `response.completed`: the events are read as they come)
        seen = list(c.responses.create(model="kvcache-default", temperature=0, max_output_tokens=12, stream=True,
                                       **request))  # fmt: skip
        assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == whole.output_text
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        assert [e.type for e in seen][:2] == ["response.created", "response.in_progress"]
        assert seen[-1].type == "response.incomplete" and seen[-1].response.output_text == whole.output_text
    # a stop string ends it: completed, which the client's stream helper rebuilds from the events
    options = {"model": "kvcache-default", "input": "The cache", "temperature": 0, "max_output_tokens": 30,
               "extra_body": {"stop": [" "]}}  # fmt: skip
    ended = c.responses.create(**options)
    assert ended.status == "completed" and ended.incomplete_details is None and " " not in ended.output_text
    with c.responses.stream(**options) as events:
        assert events.get_final_response().output_text == ended.output_text


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "objekt"}}}}, "text"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"input": "x", "extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"input": "x", "instructions": 3}, "instructions"),
])  # fmt: skip
def test_bad_responses_requests_are_400s_naming_the_field(bundled_server, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        bundled_server.client().responses.create(model="kvcache-default", **body)
    assert caught.value.body["param"] == param, caught.value.message


def test_function_calls_and_their_outputs_go_round_the_responses_api(markup_server) -> None:
    """The model calls get_weather as trained; its call and the tool's output sent back as input
    items are rendered as the chat template writes the tool turns, for the model answers them as
    trained."""
    from transformers import AutoTokenizer

    process, where = markup_server
    c = process.client()
    asked, reply = conversations(style="markup")[0], conversations(style="markup")[2]
    question = asked[0][0]["content"]
    asking = {"model": "tool-model", "input": question, "tools": FLAT, "temperature": 0, "max_output_tokens": 80}
    first = c.responses.create(**asking)
    kinds = [item.type for item in first.output]
    assert kinds == ["message", "function_call"] and first.status == "completed"
    assert first.output_text == asked[2].split("<tool_call>")[0].strip()
    call = first.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    with c.responses.stream(**asking) as events:
        streamed = events.get_final_response()
    assert [(i.type, getattr(i, "name", None)) for i in streamed.output] == [("message", None), ("function_call",
                                                                                                  "get_weather")]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": reply[0][2]["content"]}
    # the call alone (as trained: an assistant turn of calls), then the tool's output: the trained reply
    followed = c.responses.create(model="tool-model", tools=FLAT, temperature=0, max_output_tokens=40, input=[
        {"role": "user", "content": question}, call.model_dump(exclude_none=True), output])  # fmt: skip
    assert followed.output_text == reply[2] and [i.type for i in followed.output] == ["message"]
    # the text and the call as returned: one assistant turn of both, as the chat template renders it
    function = {"name": call.name, "arguments": call.arguments}
    turns = [{"role": "user", "content": question},
             {"role": "assistant", "content": first.output_text,
              "tool_calls": [{"id": call.call_id, "type": "function", "function": function}]},
             {"role": "tool", "tool_call_id": call.call_id, "content": output["output"]}]  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(where)
    rendered = tokenizer.apply_chat_template(template_messages(turns), tools=TOOLS, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    both = c.responses.create(model="tool-model", tools=FLAT, temperature=0, max_output_tokens=2, input=[
        {"role": "user", "content": question}, *[item.model_dump(exclude_none=True) for item in first.output], output])
    assert both.usage.input_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert "Let me check.<tool_call>" in rendered


def test_a_thinking_models_reasoning_is_a_reasoning_item(markup_server) -> None:
    from transformers import AutoTokenizer

    process, where = markup_server
    c = process.client()
    tokenizer = AutoTokenizer.from_pretrained(where)
    for messages, _, answer, _ in conversations(style="markup")[4:]:
        thought, content = answer.split("</think>")
        whole = c.responses.create(model="tool-model", input=messages, temperature=0, max_output_tokens=40)
        assert [item.type for item in whole.output] == ["reasoning", "message"]
        assert whole.output[0].content[0].text == thought.removeprefix("<think>").strip()
        assert whole.output_text == content.strip()
        # the tokens up to the one that closes the block: as the model was trained to write them
        through = tokenizer.encode(thought + "</think>", add_special_tokens=False)
        assert whole.usage.output_tokens_details.reasoning_tokens == len(through)
        with c.responses.stream(model="tool-model", input=messages, temperature=0, max_output_tokens=40) as events:
            seen = list(events)
            final = events.get_final_response()
        assert [item.type for item in final.output] == ["reasoning", "message"]
        assert "".join(e.delta for e in seen if e.type == "response.reasoning_text.delta") == whole.output[0].content[
            0].text  # fmt: skip
        assert final.output_text == whole.output_text
        # sent back, the reasoning item is the reasoning of the assistant turn after it, as the template renders it
        turns = [*messages, {"role": "assistant", "content": whole.output_text,
                             "reasoning_content": whole.output[0].content[0].text}, {"role": "user", "content": "Hi"}]
        rendered = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        returned = [item.model_dump(exclude_none=True) for item in whole.output]
        again = c.responses.create(model="tool-model", temperature=0, max_output_tokens=2,
                                   input=[*messages, *returned, {"role": "user", "content": "Hi"}])  # fmt: skip
        assert again.usage.input_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        assert "</think>" in rendered.split("<|im_start|>assistant")[1]
