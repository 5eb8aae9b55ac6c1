"""`kvcache serve` through the official `openai` client (and raw HTTP where a client would hide
the answer), against a server process started on a free loopback port: completions and chat,
streamed and whole, each greedy answer equal to the same prompt decoded alone (also 16 at once,
and with prompt-lookup speculation), a second chat turn reusing the first, stop strings, seeds,
OpenAI-style errors for bad requests, the API key, disconnects, SIGTERM and metrics.

The server runs the bundled model in float64 here: batched and single-row kernels differ in the
last bits (about 1e-15 in float64, 1e-6 in float32), far below the logit gaps, so greedy tokens
must be identical; in float32 a near tie can flip now and then (`benchmarks/serve.py` counts
how often).
"""

from __future__ import annotations

import codecs
import concurrent.futures
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_kit import ServeProcess, module_server, tiny_model_dir  # noqa: E402

from kvcache.generation import generate  # noqa: E402
from kvcache.generation.token_bytes import byte_reader  # noqa: E402
from kvcache.models import load_default_model  # noqa: E402
from kvcache.serve.served import bundled  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "kvcache-default"
WORDS = ("value", "name", "object", "method", "class", "list", "module", "type", "key", "file", "string", "number",
         "return", "error", "index", "loop")  # fmt: skip
PROMPTS = [f"The {w} of the " for w in WORDS]


@pytest.fixture(scope="module")
def reference():
    """The bundled model in float64, and `alone(text, n)`: the greedy continuation of one prompt
    decoded by itself (`generate`, batch 1)."""
    model, tokenizer = load_default_model(dtype=torch.float64)

    def alone(text: str, n: int) -> str:
        ids = torch.tensor([tokenizer.encode(text)])
        return tokenizer.decode(generate(model, ids, max_new_tokens=n).sequences[0, ids.shape[1] :].tolist())

    return alone


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory)



def test_completions_and_chat_streamed_and_whole_equal_a_run_alone(server, reference) -> None:
    c = server.client()
    prompt = "The value of the "
    want = reference(prompt, 40)
    whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 40
    assert whole.usage.total_tokens == len(prompt) + 40
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want and chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "What does a cache hold?"}]
    chat_want = reference(bundled().chat_prompt(messages), 30)
    answer = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert answer.choices[0].message.content == chat_want and answer.choices[0].message.role == "assistant"
    streamed = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == chat_want
    assert streamed[-1].usage.completion_tokens == 30 and streamed[-1].choices == []
    # and the command line's own greedy run of the prompt alone prints the same text
    argv = [sys.executable, "-m", "kvcache", "generate", prompt, "--max-new-tokens", "40", "--temperature", "0",
            "--dtype", "float64"]  # fmt: skip
    cli = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and cli.stdout == want + "\n"


def test_sixteen_concurrent_requests_each_equal_its_run_alone(server, reference) -> None:
    c = server.client()

    def ask(prompt: str) -> str:
        return c.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, PROMPTS))
    assert got == [reference(p, 48) for p in PROMPTS]


def test_a_second_turn_reuses_the_first_prompt_and_answer(server) -> None:
    """The answer's chunks were stored while it was decoded: turn 2 reports `cached_tokens` of at
    least turn 1's prompt and answer minus one chunk (16 tokens)."""
    c = server.client()
    messages = [{"role": "user", "content": "Tell me about the list type, at length."}]
    first = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0)
    answer = first.choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the dict type?"}]
    second = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + 60 - 16
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 60


def test_stop_strings_and_seeded_sampling(server, reference) -> None:
    c = server.client()
    prompt = "The value of the "
    full = reference(prompt, 40)
    stop = full[10:13]
    cut = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "zzzz"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == full[: full.index(stop)]
    runs = [c.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.9, top_p=0.9, seed=5)
            .choices[0].text for _ in range(2)]  # fmt: skip
    other = c.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.9, seed=6).choices[0].text
    assert runs[0] == runs[1] != other


BAD = [
    ("POST", "/v1/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n must be in [1, 64]"),
    ("POST", "/v1/completions", {"prompt": ["x"] * 9, "n": 8}, 400, "more than the 64 choices"),
    ("POST", "/v1/completions", {"prompt": ["x", ""]}, 400, "prompt must be"),
    ("POST", "/v1/completions", {"prompt": ["x", "snow \u2603"]}, 400, "cannot be encoded"),
    ("POST", "/v1/completions", {"prompt": "x", "frobnicate": True}, 400, "unrecognized"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "snow \u2603 man"}, 400, "cannot be encoded"),
    ("POST", "/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "token ids"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ("POST", "/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("POST", "/v1/completions", {"prompt": "x", "min_p": "low"}, 400, "min_p"),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream: true"),
    ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, "too many digits"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ("POST", "/v1/completions", {"prompt": "x" * (2 << 20)}, 413, "larger than"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("GET", "/v1/nothing", None, 404, "no such endpoint"),
    ("GET", "/v1/completions", None, 405, "method not allowed"),
]


def test_bad_requests_get_openai_style_errors_and_change_nothing(server) -> None:
    for method, path, body, status, words in BAD:
        content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
        answer = httpx.request(method, server.url + path, content=content, timeout=30,
                               headers={"content-type": "application/json"})  # fmt: skip
        assert answer.status_code == status, (path, body if not isinstance(body, dict) else list(body), answer.text)
        error = answer.json()["error"]
        assert words in error["message"] and error["type"] and "Traceback" not in answer.text, (words, error)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="x", temperature=-1)
    assert server.health()["running"] == 0 and server.health()["waiting"] == 0


def test_an_api_key_is_required_and_never_logged(tmp_path: Path) -> None:
    process = ServeProcess("--threads", "1", env={"KVCACHE_API_KEY": "sekrit-key-123"})
    process.start(tmp_path / "stderr.log")
    try:
        for key in ("wrong", None):
            headers = {} if key is None else {"authorization": f"Bearer {key}"}
            answer = httpx.get(f"{process.url}/v1/models", headers=headers, timeout=10)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            process.client("wrong").models.list()
        assert process.client("sekrit-key-123").models.list().data[0].id == MODEL
        assert httpx.get(f"{process.url}/health", timeout=10).status_code == 200  # health needs no key
    finally:
        assert process.terminate() == 0
    assert "sekrit" not in process.log()


def test_a_client_that_disconnects_mid_stream_cancels_its_row(server) -> None:
    body = {"model": MODEL, "prompt": "The value of the ", "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.health()["running"] == 1
    deadline = time.monotonic() + 10
    while server.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health() | {"model": 0} == {"status": "ok", "model": 0, "waiting": 0, "prefilling": 0, "running": 0,
                                               "batch_cache": 0, "store_writes_pending": 0}  # fmt: skip


def test_sigterm_lets_in_flight_requests_finish(tmp_path: Path, reference) -> None:
    process = ServeProcess("--dtype", "float64", "--threads", "1", "--shutdown-timeout", "20")
    process.start(tmp_path / "stderr.log")
    result: dict = {}

    def ask() -> None:
        result["text"] = process.client().completions.create(model=MODEL, prompt="The value of the ", max_tokens=300,
                                                            temperature=0).choices[0].text  # fmt: skip

    thread = threading.Thread(target=ask)
    thread.start()
    while process.health()["running"] == 0:
        time.sleep(0.02)
    assert process.terminate() == 0
    thread.join(timeout=30)
    assert result["text"] == reference("The value of the ", 300)


def test_metrics_count_requests_tokens_and_reuse(server) -> None:
    c = server.client()
    for _ in range(2):
        c.completions.create(model=MODEL, prompt="A prompt long enough to fill two chunks of sixteen.", max_tokens=5,
                             temperature=0)  # fmt: skip
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values['kvcache_requests_total{endpoint="completions",status="200"}'] >= 2
    assert values["kvcache_generated_tokens_total"] >= 10 and values["kvcache_prefix_hits_total"] >= 1
    assert values["kvcache_tokens_reused_total"] >= 32 and values["kvcache_time_to_first_token_seconds_count"] >= 2
    assert "kvcache_batch_size" in values


def test_prompt_lookup_speculation_gives_each_row_its_run_alone(tmp_path: Path, reference) -> None:
    """`--speculative`: rows draft from their own text, are verified together and cropped by their
    own counts; 16 concurrent greedy answers equal their runs alone."""
    process = ServeProcess("--dtype", "float64", "--threads", "1", "--speculative", "4")
    process.start(tmp_path / "stderr.log")
    try:
        c = process.client()
        prompts = [p * 3 for p in PROMPTS]  # repetitive text: drafts get accepted

        def ask(prompt: str) -> str:
            return c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(ask, prompts))
        assert got == [reference(p, 40) for p in prompts]
    finally:
        assert process.terminate() == 0


@pytest.mark.parametrize("speculative", [(), ("--speculative", "4")], ids=["plain", "speculative"])
def test_quantized_serving_gives_each_row_its_run_alone_with_the_same_quantized_cache(tmp_path: Path,
                                                                                      speculative) -> None:  # fmt: skip
    """`--kv-bits 4`: 8 concurrent greedy answers (with and without speculation) equal their runs
    alone through a quantized cache of the same kind, as `kvcache generate --kv-bits 4` runs."""
    model, tokenizer = load_default_model(dtype=torch.float64)
    model.kv_bits = 4
    process = ServeProcess("--dtype", "float64", "--threads", "1", "--kv-bits", "4", *speculative)
    process.start(tmp_path / "stderr.log")
    try:
        c = process.client()
        prompts = [p * (1 + i % 4) for i, p in enumerate(PROMPTS[:8])]  # 5 to 30 tokens: every padding

        def ask(prompt: str) -> str:
            return c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, prompts))
        for prompt, text in zip(prompts, got, strict=True):
            ids = torch.tensor([tokenizer.encode(prompt)])
            alone = generate(model, ids, max_new_tokens=40).sequences[0, ids.shape[1] :]
            assert text == tokenizer.decode(alone.tolist())
    finally:
        assert process.terminate() == 0


def test_a_transformers_model_directory_is_served(tmp_path: Path) -> None:
    """`--model DIR`: completions equal `generate(wrap_model(model))` of the prompt alone (encoded as
    the tokenizer does by default: with its BOS), also four at once; chat uses the tokenizer's own
    template; the model id is the directory's name, and `/v1/models/{id}` answers for it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcache.integrations.transformers import wrap_model

    where = tiny_model_dir(tmp_path / "tiny-llama")
    model = wrap_model(AutoModelForCausalLM.from_pretrained(where, dtype=torch.float64).eval())
    tokenizer = AutoTokenizer.from_pretrained(where)

    def alone(text: str, n: int, special: bool = True) -> str:
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=special)])
        out = generate(model, ids, max_new_tokens=n).sequences[0, ids.shape[1] :].tolist()
        return tokenizer.decode(out, skip_special_tokens=True)

    process = ServeProcess("--model", str(where), "--dtype", "float64", "--threads", "1")
    process.start(tmp_path / "stderr.log")
    try:
        c = process.client()
        assert c.models.list().data[0].id == "tiny-llama"
        prompts = ["The value of the", "the sum of its", "The cache is", "tokens. The"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: c.completions.create(model="tiny-llama", prompt=p, max_tokens=12,
                                                               temperature=0).choices[0].text, prompts))  # fmt: skip
        assert got == [alone(p, 12) for p in prompts]
        messages = [{"role": "user", "content": "The value"}]
        chat = c.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == alone(tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True), 8, special=False)  # fmt: skip
        # a completion's prompt is encoded as the tokenizer does by default: with its BOS
        assert tokenizer.encode("The value")[0] == tokenizer.bos_token_id
        whole = c.completions.create(model="tiny-llama", prompt="The value", max_tokens=3, temperature=0)
        assert whole.usage.prompt_tokens == len(tokenizer.encode("The value"))
        assert c.models.retrieve("tiny-llama").id == "tiny-llama"
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("gpt-4")
        # Streamed, each chunk's text completes the decode of the tokens so far (counted by their
        # log probabilities), less exactly what later bytes could still change, and comes with the
        # token that made it showable: this answer starts with a byte no continuation completes
        # (shown with its token), then a lead byte (it waits). (A stop string that never comes
        # makes the stream take its tokens one by one.)
        ids = torch.tensor([tokenizer.encode("The value of the")])
        tokens = generate(model, ids, max_new_tokens=12).sequences[0, ids.shape[1] :].tolist()
        read = byte_reader(tokenizer, skip_special_tokens=True)

        def showable(n: int) -> str:
            whole = tokenizer.decode(tokens[:n], skip_special_tokens=True)
            pending = codecs.getincrementaldecoder("utf-8")(errors="replace")
            pending.decode(b"".join(map(read.read, tokens[:n])))
            return whole[:-1] if pending.getstate()[0] else whole

        assert "\x00" not in tokenizer.decode(tokens) and showable(1) == "\ufffd" and showable(2) == "\ufffd"
        shown, count = "", 0
        for chunk in c.completions.create(model="tiny-llama", prompt="The value of the", max_tokens=12,
                                          temperature=0, stream=True, logprobs=0, stop=["\x00"]):  # fmt: skip
            given = len(chunk.choices[0].logprobs.tokens) if chunk.choices[0].logprobs else 0
            assert showable(count + given - 1) == shown or not chunk.choices[0].text  # not one token late
            count += given
            shown += chunk.choices[0].text
            assert shown == showable(count)
        assert count == 12 and shown == tokenizer.decode(tokens, skip_special_tokens=True)
    finally:
        assert process.terminate() == 0


def test_the_readme_serving_examples_run(server) -> None:
    """The README's curl and openai examples, run as written against a server (its port put in)."""
    import re

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Serving", 1)[1].split("\n## ", 1)[0]
    port = str(server.port)
    curl = re.findall(r"```bash\n(curl .*?)```", section, re.S)[0].replace("8000", port)
    done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["choices"][0]["text"], done.stderr
    python = re.findall(r"```python\n(.*?)```", section, re.S)[0].replace("8000", port)
    assert python.startswith("# needs `kvcache serve` running")
    exec(compile(python, "README.md (serving)", "exec"), {"__name__": "__readme__"})


def test_vllms_tool_flags_are_taken_where_they_fit_the_model(capsys) -> None:
    """`--enable-auto-tool-choice` and `--tool-call-parser` (vLLM's): a parser the model's template
    does not write is a one-line error once the model is loaded (the bundled model writes none)."""
    from kvcache.cli import main

    code = main(["serve", "--engine", "thread", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and err.count("\n") == 1 and "--tool-call-parser hermes" in err
    assert "does not write tools" in err


def test_bad_flags_are_one_line_errors(capsys) -> None:
    """Out-of-range limits, port and timeouts fail before any model loads or socket opens."""
    from kvcache.cli import main

    for argv, words in ((["--keep-alive", "0"], "--keep-alive must be > 0"),
                        (["--shutdown-timeout", "nan"], "--shutdown-timeout must be > 0"),
                        (["--port", "70000"], "--port must be in"), (["--max-batch", "0"], "--max-batch must be >= 1"),
                        (["--max-step-tokens", "0"], "--max-step-tokens must be >= 1"),
                        (["--max-num-seqs", "0"], "--max-batch must be >= 1"),  # (vLLM's names for them)
                        (["--max-num-batched-tokens", "0"], "--max-step-tokens must be >= 1"),
                        (["--prompt-lookup", "0"], "--prompt-lookup must be >= 1"),
                        (["--speculative", "2", "--prompt-lookup", "3"], "one speculation flag"),
                        (["--suffix-draft", "4", "--prompt-lookup", "3"], "alternatives"),
                        (["--device", "tpu"], "--device 'tpu'"),
                        (["--served-model-name", "m", " "], "a name must not be empty"),
                        (["--allowed-origins", "localhost:3000"], "is not an origin"),
                        (["--allowed-origins", "http://a.example/path"], "is not an origin"),
                        (["--allowed-origins", '["http://a.example"'], "not a JSON list"),
                        *([] if torch.cuda.is_available() else [(["--device", "cuda"], "CUDA is not available")])):
        code = main(["serve", *argv])
        out, err = capsys.readouterr()
        assert (code, out) == (2, "") and err.count("\n") == 1 and words in err, (argv, err)
    for argv, words in ((["--speculative", "often"], "'suffix'"), (["--port", "http"], "--port")):
        with pytest.raises(SystemExit) as exited:  # argparse's own checks exit from parse_args
            main(["serve", *argv])
        out, err = capsys.readouterr()
        code = exited.value.code
        assert (code, out) == (2, "") and err.count("\n") == 1 and words in err, (argv, err)


def test_allowed_origins_are_read_as_given_or_as_vllms_json_list() -> None:
    from kvcache.cli.serve import allowed_origins

    assert allowed_origins(['["http://localhost:3000", "https://a.example/"]', "*"]) == (
        "http://localhost:3000", "https://a.example", "*")
    assert allowed_origins(()) == ()


def test_the_help_states_the_engines_step_budget(capsys) -> None:
    """`--max-step-tokens` defaults to the engine's budget (taken from it when the flag is not
    given), and the help says which."""
    from kvcache.cli import main
    from kvcache.serve.engine import MAX_STEP_TOKENS

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert f"prompts (default {MAX_STEP_TOKENS})" in " ".join(capsys.readouterr().out.split())
