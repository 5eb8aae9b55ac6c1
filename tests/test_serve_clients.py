"""`kvcache serve` against careless and hostile clients: each case here once reached a 500, an open
server, a wrong count or another request; now each is a 4xx OpenAI error (or the neutral value
accepted), and no request's failure reaches another. Raw HTTP (httpx, sockets) where a client
library would hide the answer; the official `openai` client where it is what users run.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_kit import ServeProcess, module_server  # noqa: E402

from kvcache.generation import generate  # noqa: E402
from kvcache.models import load_default_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "kvcache-default"
ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--max-tokens", "64", "--allowed-origins", ORIGIN)


@pytest.fixture(scope="module")
def alone():
    model, tokenizer = load_default_model(dtype=torch.float64)

    def run(text: str, n: int) -> str:
        ids = torch.tensor([tokenizer.encode(text)])
        return tokenizer.decode(generate(model, ids, max_new_tokens=n).sequences[0, ids.shape[1] :].tolist())

    return run



def post(server: ServeProcess, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)


def test_malformed_bodies_are_400s(server) -> None:
    """A field name that is not valid Unicode and JSON nested a thousand deep were 500s."""
    for raw, words in ((b'{"prompt": "x", "\\ud800": 1}', "not valid Unicode"),
                       (b'{"prompt": "\\udfff"}', "not valid Unicode"),
                       (b'{"prompt": "x", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested deeper"),
                       (b'{"prompt": "x", "user": ' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper")):  # fmt: skip
        answer = post(server, "/v1/completions", raw)
        assert answer.status_code == 400, (raw[:40], answer.text)
        assert words in answer.json()["error"]["message"] and "Traceback" not in answer.text


def test_neutral_values_are_accepted_and_others_refused(server, alone) -> None:
    c = server.client()
    want = alone("User: Hi\nAssistant:", 5)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                     temperature=0, logprobs=False, response_format={"type": "text"},
                                     presence_penalty=0.0, n=1)  # fmt: skip
    assert chat.choices[0].message.content == want
    for extra, words in (({"logprobs": 1}, "logprobs"), ({"response_format": {"type": "json"}}, "response_format"),
                         ({"n": True}, "n must be an integer")):  # fmt: skip
        body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
        answer = post(server, "/v1/chat/completions", json.dumps(body).encode())
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text


def test_top_k_is_taken(server, alone) -> None:
    """`top_k: 1` samples the argmax only: the greedy answer at any temperature."""
    c = server.client()
    want = alone("The value of the ", 20)
    got = c.completions.create(model=MODEL, prompt="The value of the ", max_tokens=20, temperature=1.5, seed=3,
                               extra_body={"top_k": 1}).choices[0].text  # fmt: skip
    assert got == want
    bad = post(server, "/v1/completions", json.dumps({"prompt": "x", "top_k": 1.5}).encode())
    assert bad.status_code == 400 and "top_k" in bad.json()["error"]["message"]


def test_min_p_is_taken(server, alone) -> None:
    """`min_p: 1` keeps only the most likely token (the greedy answer at any temperature), through
    the official client's `extra_body` as vLLM users send it; a small min_p still samples."""
    c = server.client()
    prompt = "The value of the "
    want = alone(prompt, 20)

    def ask(min_p: float, seed: int) -> str:
        return c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=1.5, seed=seed,
                                    extra_body={"min_p": min_p}).choices[0].text  # fmt: skip

    assert ask(1.0, 3) == want == ask(1.0, 4)
    assert ask(0.01, 3) != ask(0.01, 4)


def test_a_vanishing_temperature_decodes_greedily_and_hurts_no_one(server, alone) -> None:
    """temperature=1e-40 made NaN probabilities: that request never answered and every request in
    flight with it got a 500. Now it is greedy decoding, and the others get their own answers."""
    c = server.client()
    prompts = ["The value of the ", "The list of the ", "The name of the ", "The key of the "]

    def ask(i: int) -> str:
        temperature = 1e-40 if i == 0 else 0
        return c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=30,
                                    temperature=temperature).choices[0].text  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, range(4)))
    assert got == [alone(p, 30) for p in prompts]


def test_stream_chunks_carry_usage_null_until_the_last(server) -> None:
    body = {"prompt": "The value of the ", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as answer:
        events = [json.loads(line[5:]) for line in answer.iter_lines() if line.startswith("data: {")]
    assert all("usage" in e and e["usage"] is None for e in events[:-1]) and len(events) > 2
    assert events[-1]["usage"]["completion_tokens"] == 5 and events[-1]["choices"] == []


def test_completion_tokens_stop_at_the_stop_string(server, alone) -> None:
    """The engine decodes on while the web side finds a stop string: usage counts the tokens up to
    the one that completed it (the bundled model is character-level: one character a token)."""
    c = server.client()
    full = alone("The value of the ", 60)
    stop = full[8:11]
    cut = full.index(stop)
    for _ in range(3):
        answer = c.completions.create(model=MODEL, prompt="The value of the ", max_tokens=60, temperature=0,
                                      stop=stop)  # fmt: skip
        assert answer.choices[0].text == full[:cut]
        assert answer.usage.completion_tokens == cut + len(stop)


def test_omitting_max_tokens_is_capped_by_the_server_limit(server) -> None:
    """`--max-tokens 64` with the default of 128: a request without max_tokens gets 64 at most."""
    answer = server.client().completions.create(model=MODEL, prompt="The value of the ", temperature=0)
    assert answer.usage.completion_tokens == 64 and answer.choices[0].finish_reason == "length"


def test_a_request_with_two_framings_is_refused_and_its_connection_closed(server) -> None:
    """Content-Length and Transfer-Encoding together (RFC 9112 6.1): a 400, the connection closed,
    and the second request smuggled in the chunked body never answered."""
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(chunked)).encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
           + chunked + smuggled)  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(raw)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 400") and received.count(b"HTTP/1.1") == 1, received[:300]
    assert b"Transfer-Encoding" in received


def test_the_queue_is_bounded_and_health_counts_the_queued(tmp_path: Path) -> None:
    """One running row and one queued request at most: the others get the documented 429, and
    /health reports the queued one as waiting (not prefilling)."""
    process = ServeProcess("--threads", "1", "--max-batch", "1", "--max-waiting", "1")
    process.start(tmp_path / "stderr.log")
    statuses: list[int] = []
    try:
        def ask() -> None:
            body = {"prompt": "The value of the ", "max_tokens": 2000, "temperature": 0}
            statuses.append(httpx.post(f"{process.url}/v1/completions", json=body, timeout=120).status_code)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        deadline = time.monotonic() + 10
        threads[0].start()  # the second is sent once the first runs (2,000 tokens: seconds, not ms)
        while process.health()["running"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        threads[1].start()
        while process.health()["waiting"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        health = process.health()
        assert (health["running"], health["waiting"], health["prefilling"]) == (1, 1, 0), health
        refused = httpx.post(f"{process.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        for t in threads:
            t.join(120)
    finally:
        assert process.terminate() == 0
    assert statuses == [200, 200]


def test_requests_cut_by_shutdown_get_openai_errors_without_tracebacks(tmp_path: Path) -> None:
    """SIGTERM with a 2 s grace and requests that need longer: the whole request gets a JSON 503,
    the stream an error event then its end, and the log holds no traceback."""
    process = ServeProcess("--threads", "1", "--shutdown-timeout", "2")
    process.start(tmp_path / "stderr.log")
    results: dict[str, object] = {}

    def whole() -> None:
        body = {"prompt": "The value of the ", "max_tokens": 4000, "temperature": 0}
        results["whole"] = httpx.post(f"{process.url}/v1/completions", json=body, timeout=60)

    def streamed() -> None:
        body = {"prompt": "The name of the ", "max_tokens": 4000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{process.url}/v1/completions", json=body, timeout=60) as answer:
            results["stream"] = [line for line in answer.iter_lines() if line.startswith("data:")]

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    while process.health()["running"] < 2:
        time.sleep(0.02)
    assert process.terminate() == 0
    for t in threads:
        t.join(30)
    answer = results["whole"]
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
    assert "shutting down" in results["stream"][-1]
    assert "Traceback" not in process.log()


@pytest.mark.parametrize("given", [["--api-key", ""], ["--api-key", "  "]])
def test_an_empty_api_key_is_a_one_line_error(given, capsys, monkeypatch) -> None:
    from kvcache.cli import main

    monkeypatch.delenv("KVCACHE_API_KEY", raising=False)
    code = main(["serve", *given])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and err.count("\n") == 1 and "--api-key is empty" in err


def test_an_empty_api_key_variable_is_a_one_line_error(capsys, monkeypatch) -> None:
    from kvcache.cli import main

    monkeypatch.setenv("KVCACHE_API_KEY", "")
    code = main(["serve"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and err.count("\n") == 1 and "$KVCACHE_API_KEY is empty" in err


def test_only_the_allowed_origins_pages_may_read_answers(server) -> None:
    """`--allowed-origins` (CORS): a browser's preflight from the allowed origin is answered with
    what its request may send (the API key's header too); another origin gets no CORS headers, so
    the browser keeps its page from reading the answer. (A server without the flag sends none:
    test_serve_vllm_extras.)"""
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    allowed = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight}, timeout=10)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight},
                          timeout=10)  # fmt: skip
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"model": MODEL, "prompt": "The value", "max_tokens": 2}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Origin": ORIGIN}, timeout=30)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Origin": "http://evil.example"},
                        timeout=30)  # fmt: skip
    assert "access-control-allow-origin" not in answer.headers
