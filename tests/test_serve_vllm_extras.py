"""vLLM's extras on `kvcache serve`: `/tokenize` and `/detokenize` (the ids a completion or a chat
request would feed the model, checked against the token counts the answers' `usage` reports, and
their text back), a chat's `continue_final_message` (a prefilled answer, continued as the same
text sent as a completion is), `truncate_prompt_tokens`, `reasoning_effort` as the template's
variable, and 4xx errors for what they do not take."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_kit import module_server

from kvcache.serve.served import bundled

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_tokenize_gives_the_ids_a_request_feeds_and_detokenize_their_text(server) -> None:
    model = bundled()
    prompt = "The value of the list"
    answer = post(server, "/tokenize", {"model": "kvcache-default", "prompt": prompt, "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    shaped = answer.json()
    assert shaped["tokens"] == model.encode(prompt) and shaped["count"] == len(prompt)  # one character a token
    assert shaped["token_strs"] == list(prompt) and shaped["max_model_len"] is None  # (no context limit)
    completion = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0}).json()
    assert completion["usage"]["prompt_tokens"] == shaped["count"]
    messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "What is a list?"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == model.encode(model.chat_prompt(messages)) and chat["token_strs"] is None
    answered = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0}).json()
    assert answered["usage"]["prompt_tokens"] == chat["count"]
    back = post(server, "/detokenize", {"model": "kvcache-default", "tokens": chat["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": model.chat_prompt(messages)}


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/tokenize", {"add_generation_prompt": False, "continue_final_message": True,
                   "messages": [{"role": "user", "content": "x"}]}, 400, "the last message to be the assistant's"),
    ("/v1/chat/completions", {"continue_final_message": True, "messages": [{"role": "assistant", "content": "x"}]},
     400, "cannot both be true"),
    ("/v1/chat/completions", {"add_generation_prompt": "no", "messages": [{"role": "user", "content": "x"}]},
     400, "add_generation_prompt must be a boolean"),
    ("/tokenize", {"prompt": ["a", "b"]}, 400, "one string"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs must be a boolean"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "unrecognized"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "does not exist"),
    ("/tokenize", {"prompt": "snow \u2603"}, 400, "cannot be encoded"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens must be in [0, 103)"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens must be a list"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "unrecognized"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "does not exist"),
])  # fmt: skip
def test_what_they_do_not_take_is_an_openai_error(server, path: str, body: dict, status: int, words: str) -> None:
    answer = post(server, path, body)
    assert answer.status_code == status and words in answer.json()["error"]["message"], answer.text


def test_a_prefilled_answer_is_continued_as_the_same_text_sent_as_a_completion(server) -> None:
    """`continue_final_message` (with `add_generation_prompt: false`): the prompt ends inside the
    assistant's last message, and the answer continues it, whole and streamed, as a completion of
    that very text does; `/tokenize` counts the same ids."""
    model = bundled()
    messages = [{"role": "user", "content": "What does a list hold?"}, {"role": "assistant", "content": "A list holds"}]
    text = model.chat_prompt(messages, generation_prompt=False, continue_final=True)
    assert text.endswith("Assistant:A list holds")
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    want = post(server, "/v1/completions", {"prompt": text, "max_tokens": 24, "temperature": 0}).json()
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 24, "temperature": 0, **extra})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    assert chat.json()["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] == len(text)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                      json={"messages": messages, "max_tokens": 24, "temperature": 0, "stream": True, **extra}) as s:
        pieces = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces) == want["choices"][0]["text"]
    counted = post(server, "/tokenize", {"messages": messages, **extra}).json()
    assert counted["tokens"] == model.encode(text)
    plain = post(server, "/tokenize", {"messages": messages[:1], "add_generation_prompt": False}).json()
    assert plain["tokens"] == model.encode("User: What does a list hold?\n")


def test_truncate_prompt_tokens_keeps_the_prompts_end(server) -> None:
    """vLLM's `truncate_prompt_tokens`: k keeps the prompt's last k tokens (the answer is that of
    the cut prompt sent whole; an echo shows the cut prompt), -1 as many as the server takes (here
    `--max-prompt-tokens`' 8,192: the bundled model has no context limit), so a longer prompt is
    answered rather than refused."""
    prompt = "The value of the list is the sum of its items. The value of the "
    cut = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                           "truncate_prompt_tokens": 20, "echo": True}).json()  # fmt: skip
    whole = post(server, "/v1/completions", {"prompt": prompt[-20:], "max_tokens": 12, "temperature": 0}).json()
    assert cut["usage"]["prompt_tokens"] == 20
    assert cut["choices"][0]["text"] == prompt[-20:] + whole["choices"][0]["text"]
    long = "The value of the list. " * 400  # 9,200 characters, as many tokens at the bundled model
    refused = post(server, "/v1/completions", {"prompt": long, "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    kept = post(server, "/v1/completions", {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": -1})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 8192
    for bad in (0, -2, 1.5, True, "all"):
        answer = post(server, "/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": bad})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "truncate_prompt_tokens", bad


def test_version_says_the_packages(server) -> None:
    from kvcache import __version__

    answer = httpx.get(f"{server.url}/version", timeout=30)
    assert answer.status_code == 200 and answer.json() == {"version": __version__}
    # without --allowed-origins no web page elsewhere may read an answer (no CORS headers)
    answer = httpx.get(f"{server.url}/version", headers={"Origin": "http://localhost:3000"}, timeout=30)
    assert "access-control-allow-origin" not in answer.headers


EFFORT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                   "{% if reasoning_effort is defined %}effort {{ reasoning_effort }}\n{% endif %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip


def test_reasoning_effort_is_the_templates_variable(tmp_path) -> None:
    """OpenAI's `reasoning_effort` (and the Responses API's `reasoning.effort`) reach the chat
    template as its `reasoning_effort` variable, as vLLM passes it (gpt-oss's template reads it):
    the same prompt as `chat_template_kwargs` gives, which still win."""
    from serve_kit import ServeProcess, tiny_model_dir

    where = tiny_model_dir(tmp_path / "tiny", "llama")
    server = ServeProcess("--model", str(where), "--chat-template", EFFORT_TEMPLATE, "--threads", "1",
                          "--dtype", "float64").start(tmp_path / "serve.log")  # fmt: skip
    try:
        client, messages = server.client(), [{"role": "user", "content": "The value"}]

        def chat(**options):
            answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                    **options)  # fmt: skip
            return answer.choices[0].message.content, answer.usage.prompt_tokens

        low = chat(reasoning_effort="low")
        assert low == chat(extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}}) and low[1] > chat()[1]
        high = chat(extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
        assert chat(reasoning_effort="low", extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}) == high
        response = client.responses.create(model="tiny", input=messages, max_output_tokens=6, temperature=0,
                                           reasoning={"effort": "low"})  # fmt: skip
        assert (response.output_text, response.usage.input_tokens) == low
        for path, body, param in (("/v1/chat/completions", {"messages": messages, "reasoning_effort": "extreme"},
                                   "reasoning_effort"),
                                  ("/v1/responses", {"input": "x", "reasoning": "low"}, "reasoning")):  # fmt: skip
            answer = post(server, path, body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    finally:
        assert server.terminate() == 0, server.log()
