"""A bounded load test of `kvcache serve`: 32 concurrent clients, 320 requests in two rounds of
160 (greedy completions, streamed chat, streams the client drops after the first chunk, malformed
bodies), with a time limit. No request may fail or get a wrong answer (every greedy answer equals
its prompt decoded alone), and afterwards the server holds no request, row or batch cache, and
its memory after the second round is where the first left it (the prefix store's budget is
small, so it is full after the first round)."""

from __future__ import annotations

import concurrent.futures
import os
import random
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from serve_kit import ServeProcess  # noqa: E402

from kvcache.generation import generate  # noqa: E402
from kvcache.models import load_default_model  # noqa: E402
from kvcache.serve.served import bundled  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
#: requests per round: 160 with KVCACHE_SLOW=1 (the leak check compares two rounds)
CLIENTS, PER_ROUND, NEW = 32, 160 if os.environ.get("KVCACHE_SLOW") == "1" else 72, 24
TIME_LIMIT_S = 240
WORDS = ("value", "name", "object", "method", "class", "list", "module", "type", "key", "file")


def test_thirty_two_clients_get_right_answers_and_leave_nothing_behind(tmp_path) -> None:
    model, tokenizer = load_default_model(dtype=torch.float64)
    prompts = [f"{a.capitalize()} and {b}: the " for a in WORDS[:6] for b in WORDS[4:]]  # 36 distinct prompts
    chat_template = bundled().chat_prompt
    expected: dict[str, str] = {}

    def alone(text: str) -> str:
        if text not in expected:
            ids = torch.tensor([tokenizer.encode(text)])
            expected[text] = tokenizer.decode(generate(model, ids, max_new_tokens=NEW).sequences[0, ids.shape[1]:]
                                              .tolist())  # fmt: skip
        return expected[text]

    server = ServeProcess("--dtype", "float64", "--threads", "1", "--prefix-store-bytes", str(4 << 20))
    server.start(tmp_path / "stderr.log")
    deadline = time.monotonic() + TIME_LIMIT_S
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)

    def one(i: int) -> str:
        """Request `i`; returns what went wrong ('' when nothing did)."""
        if time.monotonic() > deadline:
            return "over the time limit"
        rng = random.Random(i)
        kind = rng.choice(["completion"] * 5 + ["chat"] * 2 + ["drop", "malformed"])
        prompt = rng.choice(prompts)
        if kind == "completion":
            text = client.completions.create(model="kvcache-default", prompt=prompt, max_tokens=NEW,
                                             temperature=0).choices[0].text  # fmt: skip
            return "" if text == alone(prompt) else f"wrong completion for {prompt!r}"
        if kind == "chat":
            messages = [{"role": "user", "content": prompt}]
            stream = client.chat.completions.create(model="kvcache-default", messages=messages, max_tokens=NEW,
                                                    temperature=0, stream=True)  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            return "" if text == alone(chat_template(messages)) else f"wrong chat answer for {prompt!r}"
        if kind == "drop":
            body = {"prompt": prompt, "max_tokens": 2000, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as answer:
                next(line for line in answer.iter_lines() if line.startswith("data:"))
            return ""  # closed after the first chunk: the row must leave
        bad = rng.choice([b"{", b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": -3}'])
        answer = httpx.post(f"{server.url}/v1/completions", content=bad, timeout=60,
                            headers={"content-type": "application/json"})  # fmt: skip
        return "" if answer.status_code == 400 and "error" in answer.json() else f"malformed got {answer.status_code}"

    try:
        rss = []
        for round_ in range(2):
            with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
                problems = [p for p in pool.map(one, range(round_ * PER_ROUND, (round_ + 1) * PER_ROUND)) if p]
            assert problems == [], problems[:5]
            settle = time.monotonic() + 10
            while any(server.health()[k] for k in ("waiting", "prefilling", "running", "batch_cache")):
                assert time.monotonic() < settle, server.health()
                time.sleep(0.05)
            rss.append(server.rss_bytes())
        assert rss[1] <= rss[0] * 1.1 + (16 << 20), rss
    finally:
        assert server.terminate() == 0, server.log()
